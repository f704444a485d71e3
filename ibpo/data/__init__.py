"""Problems with verifiable answers: where they come from and how the model is asked them.

  example.py  Example: one problem, its gold answer, its row's columns
  tasks.py    the built-in tasks (data.dataset: builtin:<name>) and their fixed held-out split
  splits.py   data.dataset (built-in, local file, Hub dataset, rows given in Python) read into
              training and held-out examples: load_splits
  rows.py     a dataset's rows read as examples: columns, chats, gold answers (rows_to_examples)
  files.py    local JSON / JSON Lines / Parquet files, checked, with errors that name the line
  prompts.py  the text the model continues for a problem (render_example, render_prompt)
  stream.py   the training examples as drawn: PromptStream (a table, seeded, sharded,
              shuffled), RowStream (an IterableDataset read as drawn)

Not here: tokenisation for the model (generation/) and grading (rewards/).
"""

from ibpo.data.example import Example
from ibpo.data.files import read_json_records, read_parquet_file
from ibpo.data.prompts import (
    describe_prompts,
    drop_long_prompts,
    prompt_fits,
    prompt_messages,
    prompt_template,
    render_example,
    render_messages,
    render_prompt,
    render_user_message,
    special_prefix,
    thinking_note,
    user_message,
)
from ibpo.data.rows import gold_answer, rows_to_examples
from ibpo.data.splits import IN_MEMORY, load_splits
from ibpo.data.stream import PromptStream, RowStream, StreamedRows, training_stream
from ibpo.data.tasks import builtin_examples

__all__ = [
    "IN_MEMORY",
    "Example",
    "PromptStream",
    "RowStream",
    "StreamedRows",
    "builtin_examples",
    "describe_prompts",
    "drop_long_prompts",
    "gold_answer",
    "load_splits",
    "prompt_fits",
    "prompt_messages",
    "prompt_template",
    "read_json_records",
    "read_parquet_file",
    "render_example",
    "render_messages",
    "render_prompt",
    "render_user_message",
    "rows_to_examples",
    "special_prefix",
    "thinking_note",
    "training_stream",
    "user_message",
]
