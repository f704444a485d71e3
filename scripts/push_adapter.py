"""Upload a trained LoRA adapter to the Hugging Face Hub with a model card (same as `ibpo push`).

    python scripts/push_adapter.py outputs/my-run --repo-id alice/qwen3-1.7b-gsm8k-ibpo
    python scripts/push_adapter.py outputs/my-run --repo-id alice/x --dry-run  # stage and list only

Uploads the adapter, tokenizer, recipe (ibpo_config.yaml), summary.json, metrics.jsonl, plots and a
README.md model card; never checkpoints or optimizer state. Private unless --public. The token comes
from HF_TOKEN or `hf auth login`. Options: --help (ibpo/hub/push.py).
"""

import sys

from ibpo.hub.push import main

if __name__ == "__main__":
    sys.exit(main())
