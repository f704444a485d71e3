"""Multi-turn rollouts with tool calls (rollout.tools): `ToolRollouts`, a Generator.

A row decodes until it ends its turn (EOS) or its token budget runs out. The calls its turn
wrote in the chat template's format (tools/calls.py) then run, concurrently across the rows
(rollout.tool_workers), and their results are appended as the template's tool turn (its text
after the assistant turn, up to the next assistant header: `tool_turn_text`); the row decodes
again from there, up to rollout.max_tool_calls calls and max_new_tokens tokens in all (tool
tokens count: they take context). The batch syncs at tool boundaries: every live row decodes
its turn, the calls of all run, then every row still going decodes again from its whole
context (HF generate, a fresh prompt forward per round: the hf backend's KV cache is not kept
across rounds).

The Rollout is the one the step consumes, with its completion = every turn's tokens, the
assistant's and the tools', and `completion_mask` = 1 on the tokens the policy wrote (its
turns, each with its closing EOS) and 0 on the tool turns; attention covers both, so the
trainer's forward over the whole conversation sees what decoding saw, and the behaviour
log-probs are those of the policy's tokens (0 on tool tokens). `tool_traces` holds each row's
conversation (assistant turns, with their `tool_calls`, and tool turns, as TRL passes
completions), its calls and its failed calls.

Not here: tool schemas, parsing and running calls (ibpo/tools/), the masks' use (step.py),
grading, repairs (off for tool rollouts: docs/tools.md says why).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ibpo.config import ConfigError, DataConfig
from ibpo.data import prompt_messages
from ibpo.generation.decode import DecodeEngine, Sampling
from ibpo.generation.hf import engine_decode, generate_kwargs
from ibpo.generation.rollout import Rollout, encode_prompts, eos_ids
from ibpo.generation.sampling import SampledLogprobs
from ibpo.tools import Tool, ToolCall, ToolResult, parse_tool_calls, run_calls


@dataclass
class ToolTrace:
    """One completion as a conversation: its assistant turns (with the calls each made, as
    `tool_calls`) and tool turns; the calls it made and how many of them failed."""

    messages: list[dict] = field(default_factory=list)
    calls: int = 0
    errors: int = 0


@dataclass
class _Row:
    prompt: list[int]  # the prompt's real ids
    tokens: list[int] = field(default_factory=list)  # every turn's, policy's and tools'
    policy: list[float] = field(default_factory=list)  # 1: the policy wrote it
    logp: list[float] = field(default_factory=list)  # behaviour log-prob (0 on tool tokens)
    trace: ToolTrace = field(default_factory=ToolTrace)
    calls: list[ToolCall] = field(default_factory=list)  # this turn's, waiting for results
    done: bool = False
    cut: bool = False  # the token budget ran out


LIMIT_REACHED = "Error: the limit of {} tool calls per completion is reached; this call did not run"


class ToolRollouts:
    """The policy's own generate() with tools (the Generator contract of rollout.py):
    `tools` by name (tools.resolve_tools), rollout.max_tool_calls, tool_workers and
    tool_timeout; `chat_kwargs`: what the chat template gets besides the messages
    (enable_thinking); `engine`: decode each turn with the package's engine (hf.decode_engine;
    None: HF generate). `render` gives a problem's prompt with the tools described."""

    def __init__(self, model: nn.Module, tools: dict[str, Tool], max_calls: int, workers: int,
                 timeout: float, chat_kwargs: dict | None = None,
                 engine: DecodeEngine | None = None):  # fmt: skip
        self.model, self.tools, self.max_calls, self.engine = model, tools, max_calls, engine
        self.workers, self.timeout = workers, timeout
        self.chat_kwargs = dict(chat_kwargs or {})
        self._turns: dict[tuple[int, str], list[str]] = {}

    @property
    def schemas(self) -> list[dict]:
        return [t.schema for t in self.tools.values()]

    def render(self, tokenizer, example, cfg: DataConfig) -> str:
        """A problem's prompt as a chat (data.prompts.prompt_messages) with the tools'
        schemas in the chat template, which describes them as the model was taught."""
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "rollout.tools needs a chat template that describes tools (Qwen3's does): "
                "this tokenizer has none. Fix: train a chat model, or set rollout.tools=[]"
            )
        return tokenizer.apply_chat_template(
            prompt_messages(example, cfg),
            tools=self.schemas,
            add_generation_prompt=True,
            tokenize=False,
            **self.chat_kwargs,
        )

    @torch.no_grad()
    def __call__(self, tokenizer, prompts: list[str], num_samples: int, max_new_tokens: int,
                 batch_size: int, do_sample: bool = True, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, logits_processor=None) -> Rollout:  # fmt: skip
        model = self.model
        device = next(p for p in model.parameters()).device
        ids, mask = encode_prompts(tokenizer, prompts, num_samples, "cpu")
        rows = [_Row([t for t, m in zip(r, k) if m]) for r, k in zip(ids.tolist(), mask.tolist())]
        eos = eos_ids(tokenizer, model)
        sampler = (temperature, top_k, top_p) if do_sample else None
        work = {"prefill": 0, "slots": 0}
        was_training = model.training
        model.eval()
        try:
            while live := [r for r in rows if not r.done]:
                for s in range(0, len(live), batch_size):
                    part, todo = live[s : s + batch_size], (sampler, logits_processor, work)
                    self._turn(part, tokenizer, eos, max_new_tokens, *todo)
                self._answer([r for r in live if r.calls], tokenizer, eos, max_new_tokens)
        finally:
            model.train(was_training)
        return _assemble(rows, ids.to(device), mask.to(device), tokenizer, do_sample, work)

    def _turn(self, rows, tokenizer, eos, budget, sampler, processors, work) -> None:
        """One assistant turn of each row (one generate call): appended to the row, its calls
        read; a row without calls, or out of budget, is done."""
        contexts = [r.prompt + r.tokens for r in rows]
        width = max(len(c) for c in contexts)
        pad = tokenizer.pad_token_id
        device = next(p for p in self.model.parameters()).device
        ids = torch.tensor([[pad] * (width - len(c)) + c for c in contexts], device=device)
        mask = torch.ones_like(ids)
        for i, c in enumerate(contexts):
            mask[i, : width - len(c)] = 0
        room = [budget - len(r.tokens) for r in rows]
        new, logp = self._decode(ids, mask, tokenizer, eos, max(room), sampler, processors)
        work["prefill"] += sum(len(c) for c in contexts)
        work["slots"] += new.shape[0] * new.shape[1]
        for i, (r, row) in enumerate(zip(rows, new.tolist())):
            end = next((k + 1 for k, t in enumerate(row) if t in eos), len(row))
            take = min(end, room[i])
            turn = row[:take]
            ended = take == end and bool(turn) and turn[-1] in eos
            r.tokens += turn
            r.policy += [1.0] * len(turn)
            r.logp += logp[i][:take] if logp else [0.0] * len(turn)
            self._read_turn(r, turn[:-1] if ended else turn, ended, tokenizer)

    def _decode(self, ids, mask, tokenizer, eos, max_new, sampler, processors):
        """One generate call from the rows' whole contexts -> (new tokens [n, t], their
        behaviour log-probs as lists, or None when greedy): the engine's where it runs, else
        HF generate's with ibpo's sampler as its last logits processor."""
        kwargs = generate_kwargs(self.model, tokenizer, max_new, eos)
        gen_model = getattr(self.model, "module", self.model)  # DDP has no .generate
        processors = list(processors or [])
        if self.engine is not None:
            sampling = Sampling(sampler is not None, *(sampler or (1.0, 0, 1.0)))
            inputs = {"input_ids": ids, "attention_mask": mask}
            decoded = engine_decode(self.engine, gen_model, inputs, kwargs, sampling, processors)
            if decoded is not None:
                new, logp = decoded
                return new, None if logp is None else logp.tolist()
        recorder = SampledLogprobs(*sampler) if sampler else None
        out = gen_model.generate(
            input_ids=ids,
            attention_mask=mask,
            logits_processor=processors + ([recorder] if recorder else []),
            **kwargs,
        )
        new = out[:, ids.shape[1] :]
        return new, recorder.finish(new).tolist() if recorder else None

    def _read_turn(self, r: _Row, turn: list[int], ended: bool, tokenizer) -> None:
        text = tokenizer.decode(turn, skip_special_tokens=False)
        calls = parse_tool_calls(text) if ended else []
        message: dict = {"role": "assistant", "content": text}
        readable = [c for c in calls if c.error is None]
        if readable:  # as TRL's conversations hold them (an unreadable call is only text)
            message["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in readable
            ]
        r.trace.messages.append(message)
        if not ended:
            r.done = r.cut = True
        elif not calls or r.trace.calls >= self.max_calls:
            r.done = True  # answered, or a call past the limit: the completion ends here
        else:
            r.calls = calls

    def _answer(self, rows: list[_Row], tokenizer, eos: list[int], budget: int) -> None:
        """Run the calls the rows' turns made (all rows' at once), append each row's results
        as the template's tool turn; a row whose tool turn does not fit its budget is done."""
        jobs, limited = [], []
        for r in rows:
            allowed = max(0, self.max_calls - r.trace.calls)
            jobs += r.calls[:allowed]
            limited.append(len(r.calls) - allowed if len(r.calls) > allowed else 0)
        results = iter(run_calls(jobs, self.tools, self.workers, self.timeout))
        for r, over in zip(rows, limited):
            mine = [next(results) for _ in range(len(r.calls) - over)]
            message = LIMIT_REACHED.format(self.max_calls)
            mine += [ToolResult(c.name, message, True) for c in r.calls[len(r.calls) - over :]]
            r.trace.calls += len(r.calls)
            r.trace.errors += sum(x.error for x in mine)
            r.trace.messages += [
                {"role": "tool", "name": x.name, "content": x.content} for x in mine
            ]
            last = r.tokens[-1] if r.tokens and r.tokens[-1] in eos else None
            text = self.tool_turn_text(tokenizer, [x.content for x in mine], last)
            appended = tokenizer(text, add_special_tokens=False)["input_ids"]
            room = budget - len(r.tokens)
            if len(appended) >= room:  # no room left for the policy to answer
                appended, r.done, r.cut = appended[:room], True, True
            r.tokens += appended
            r.policy += [0.0] * len(appended)
            r.logp += [0.0] * len(appended)
            r.calls = []

    def tool_turn_text(self, tokenizer, results: list[str], eos_token: int | None) -> str:
        """The text the chat template puts after an assistant turn that called tools: the turn's
        end (unless the policy's EOS already wrote it), the tool turn(s) holding `results`, and
        the next assistant header (with what the template opens it with, e.g. Qwen3's empty
        think block when thinking is off). Found by rendering a conversation with markers."""
        eos_text = "" if eos_token is None else tokenizer.decode([eos_token])
        key = (len(results), eos_text)
        if key not in self._turns:
            pieces = _tool_turn_pieces(tokenizer, len(results), eos_text, self.chat_kwargs)
            self._turns[key] = pieces
        pieces = self._turns[key]
        return pieces[0] + "".join(r + p for r, p in zip(results, pieces[1:]))


_TURN = "IBPO-ASSISTANT-TURN"
_RESULT = "IBPO-TOOL-RESULT-{}"


def _tool_turn_pieces(tokenizer, count: int, eos_text: str, chat_kwargs: dict) -> list[str]:
    """The template's text after an assistant turn and before the next one's content, split at
    the `count` tool results: count + 1 pieces."""
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _TURN}]
    messages += [{"role": "tool", "content": _RESULT.format(k)} for k in range(count)]
    full = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **chat_kwargs
    )
    after = full[full.index(_TURN) + len(_TURN) :]
    if eos_text and after.startswith(eos_text):
        after = after[len(eos_text) :]
    pieces = []
    for k in range(count):
        head, marker, after = after.partition(_RESULT.format(k))
        if not marker:
            raise ConfigError(
                "the tokenizer's chat template does not render tool messages (role 'tool'), so "
                "tool results cannot be given to the model. Fix: use a template that does "
                "(Qwen3's), or set rollout.tools=[]"
            )
        pieces.append(head)
    return pieces + [after]


def _assemble(rows: list[_Row], prompt_ids, prompt_mask, tokenizer, sampled: bool, work) -> Rollout:
    """Rows -> the Rollout: prompts as encoded (left-padded), completions right-padded, the
    policy's tokens as the completion mask (rollout.py's Rollout docs)."""
    device = prompt_ids.device
    width = max(1, max(len(r.tokens) for r in rows))
    n = len(rows)
    # built on the host from the rows' Python lists, then moved to the prompts' device once
    host = torch.device("cpu")
    ids = torch.full((n, width), tokenizer.pad_token_id, dtype=torch.long, device=host)
    policy, attend, logp = (torch.zeros(n, width, device=host) for _ in range(3))
    for i, r in enumerate(rows):
        k = len(r.tokens)
        ids[i, :k] = torch.tensor(r.tokens, dtype=torch.long)
        policy[i, :k], logp[i, :k] = torch.tensor(r.policy), torch.tensor(r.logp)
        attend[i, :k] = 1
    cut = [r.cut for r in rows]
    return Rollout(
        input_ids=torch.cat([prompt_ids, ids.to(device)], 1),
        attention_mask=torch.cat([prompt_mask, attend.long().to(device)], 1),
        completion_mask=policy.to(device),
        prompt_len=prompt_ids.shape[1],
        texts=[tokenizer.decode(r.tokens, skip_special_tokens=True) for r in rows],
        truncated=torch.tensor(cut, device=device),
        tokens=[list(r.tokens) for r in rows],
        prompt_lengths=[len(r.prompt) for r in rows],
        cut_off=cut,
        logprobs=logp.to(device) if sampled else None,
        prefill_tokens=work["prefill"],
        decode_slots=work["slots"],
        policy_lengths=[int(sum(r.policy)) for r in rows],
        tool_traces=[r.trace for r in rows],
    )


def tool_columns(traces: list[ToolTrace] | None) -> dict[str, list] | None:
    """What reward functions get of a tool rollout (rewards.functions.grade_completions): each
    completion's conversation, and the columns tool_calls and tool_errors; None without
    tools."""
    if traces is None:
        return None
    return {
        "conversations": [[dict(m) for m in t.messages] for t in traces],
        "tool_calls": [t.calls for t in traces],
        "tool_errors": [t.errors for t in traces],
    }
