"""Will it fit? The memory planner: what each phase of a step holds (phases), the fit and its
suggestions (fit); shapes and byte counts come from ibpo.sizes."""
