"""A stand-in for the part of vLLM's offline API that ibpo calls (LLM, SamplingParams,
lora.request.LoRARequest), run by transformers + PEFT on CPU, so that tests drive the vllm
backend end to end without a GPU. What the tests rely on behaves as vLLM's does: an adapter is
read from disk once per lora_int_id and then kept (a changed adapter under an old id is served
stale), nothing is generated while the engine sleeps, a completion's token_ids end with the
stop token that ended it, sample j of a request is drawn with seed + j, and greedy requests must
have n=1, and with logprobs=0 each completion carries per token {token id: Logprob} of the
sampled token under the distribution it was drawn from (the engine must be started with
logprobs_mode="processed_logprobs", as ibpo starts it). Decoding is a plain loop (no KV cache).
"""

import copy

import torch

__version__ = "0.0+tests"
ENGINES: list = []  # every LLM made, newest last: tests inspect what ibpo asked of it


class SamplingParams:
    def __init__(
        self,
        n=1,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_tokens=16,
        seed=None,
        stop_token_ids=None,
        detokenize=True,
        logprobs=None,
    ):
        if temperature == 0 and n > 1:
            raise ValueError("n must be 1 when using greedy sampling")
        self.n, self.temperature, self.top_p, self.top_k = n, temperature, top_p, top_k
        self.max_tokens, self.seed, self.stop_token_ids = max_tokens, seed, stop_token_ids or []
        self.detokenize, self.logprobs = detokenize, logprobs


class Logprob:
    def __init__(self, logprob):
        self.logprob, self.rank, self.decoded_token = logprob, None, None


class _Completion:
    def __init__(self, index, token_ids, finish_reason, stop_reason):
        self.index, self.token_ids = index, token_ids
        self.finish_reason, self.stop_reason, self.text = finish_reason, stop_reason, None
        self.logprobs = None


class _RequestOutput:
    def __init__(self, prompt_token_ids, outputs):
        self.prompt_token_ids, self.outputs = prompt_token_ids, outputs


class LLM:
    def __init__(self, model, logprobs_mode="raw_logprobs", **kwargs):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.kwargs, self.logprobs_mode = kwargs, logprobs_mode
        self.base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.adapters: dict[int, torch.nn.Module] = {}
        self.asleep, self.sleeps, self.requests = False, 0, []
        ENGINES.append(self)

    def sleep(self, level=1):
        assert level == 1 and self.kwargs.get("enable_sleep_mode"), "sleep mode not enabled"
        self.asleep, self.sleeps = True, self.sleeps + 1

    def wake_up(self, tags=None):
        self.asleep = False

    def _model(self, lora):
        if lora is None:
            return self.base
        if lora.lora_int_id not in self.adapters:
            from peft import PeftModel

            with torch.random.fork_rng():  # PEFT's random LoRA init before loading must
                # not move the caller's RNG (the engine stands for another program)
                model = PeftModel.from_pretrained(copy.deepcopy(self.base), lora.lora_path)
            self.adapters[lora.lora_int_id] = model.eval()
        return self.adapters[lora.lora_int_id]

    @torch.no_grad()
    def generate(self, prompts, sampling_params, lora_request=None, use_tqdm=True):
        if self.asleep:
            raise RuntimeError("generate() on a sleeping engine")
        params = sampling_params
        if not isinstance(params, list):
            params = [params] * len(prompts)
        model = self._model(lora_request)
        self.requests.append((len(prompts), lora_request))
        self.last_params = params
        outs = []
        for prompt, p in zip(prompts, params):
            ids, seed = prompt["prompt_token_ids"], p.seed or 0
            outs.append(
                _RequestOutput(ids, [self._one(model, ids, p, seed + k, k) for k in range(p.n)])
            )
        return outs

    def _one(self, model, prompt, p, seed, index):
        gen = torch.Generator().manual_seed(seed)
        tokens: list[int] = []
        logprobs = []
        for _ in range(p.max_tokens):
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1].float()
            if p.temperature == 0:
                token = int(logits.argmax())
                scores = logits
            else:
                scores = logits / p.temperature
                probs = torch.softmax(scores, -1)
                token = int(torch.multinomial(probs, 1, generator=gen))
            # processed: after temperature (this stand-in applies no top-k / top-p)
            raw = self.logprobs_mode == "raw_logprobs"
            lp = torch.log_softmax(logits if raw else scores, -1)[token]
            logprobs.append({token: Logprob(float(lp))})
            tokens.append(token)
            if token in p.stop_token_ids or token == self.tokenizer.eos_token_id:
                break
        done = tokens[-1] in p.stop_token_ids or tokens[-1] == self.tokenizer.eos_token_id
        reason = None if tokens[-1] == self.tokenizer.eos_token_id else tokens[-1]
        out = _Completion(index, tokens, "stop" if done else "length", reason if done else None)
        out.text = self.tokenizer.decode(tokens, skip_special_tokens=True) if p.detokenize else ""
        out.logprobs = logprobs if p.logprobs is not None else None
        return out
