"""Test helpers for tool rollouts: a character tokenizer whose chat template describes tools
and renders tool turns, a tiny Qwen3 for it, and a logits processor that scripts turns."""

from tests.conftest import CHARS, SPECIALS, make_tiny_qwen3

TOOL_CHARS = CHARS + [
    c for c in "{}\",_()[]'ABCDEFGHIJKLMNOPRSTUVXYZ!#$%&@^|~;`\\" if c not in CHARS
]
TOOL_TEMPLATE = (
    "{%- if tools %}<system>tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
    "<eos>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}<tool>{{ m['content'] }}<eos>\n"
    "{%- else %}<{{ m['role'] }}>{{ m['content'] }}<eos>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
HEADER = "<assistant>"


def tool_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + TOOL_CHARS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    # as in Qwen3's tokenizer, the tags are tokens of their own (not special: decoding keeps them)
    tok.add_tokens(["<tool_call>", "</tool_call>", "<tool>", HEADER])
    tok.chat_template = TOOL_TEMPLATE
    tok.padding_side = "left"
    return tok


def tool_model(tok, seed: int = 0):
    model = make_tiny_qwen3(len(tok), seed)
    model.config.max_position_embeddings = 1024
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model


def call_text(name: str, **arguments) -> str:
    import json

    body = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))
    return "<tool_call>" + body + "</tool_call>"


class ScriptedTurns:
    """Forces the assistant's turn k to be turns[k] followed by EOS (None: the model samples
    that turn freely). The turn is told by the assistant headers in the row: the prompt ends
    with one, and each tool turn ends with the next."""

    def __init__(self, tok, turns: list[str | None]):
        self.header = tok(HEADER, add_special_tokens=False)["input_ids"]
        self.turns = [
            None
            if t is None
            else tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            for t in turns
        ]

    def __call__(self, input_ids, scores):
        h = self.header
        for i, row in enumerate(input_ids.tolist()):
            starts = [k + len(h) for k in range(len(row) - len(h) + 1) if row[k : k + len(h)] == h]
            if not starts:
                continue
            turn, pos = len(starts) - 1, len(row) - starts[-1]
            script = self.turns[turn] if turn < len(self.turns) else None
            if script is not None and pos < len(script):
                scores[i] = float("-inf")
                scores[i, script[pos]] = 0.0
        return scores
