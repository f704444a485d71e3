"""The Hugging Face Hub: pushing a run's adapter (push) with its model card (card)."""
