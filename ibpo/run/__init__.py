"""Running a training job around the step: checkpoints and exact resume (checkpoint), the
output folder (outdir), signals and failures (failures), what a run writes as it goes (log), the
end-of-run report and plots (report)."""
