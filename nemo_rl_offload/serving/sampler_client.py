"""The sampler behind megatron-core's HTTP endpoints: what its ``InferenceClient`` is to them.

The endpoints call ``client.add_request`` once per choice; this client gathers the requests
that arrive while a sampler call runs, grouped by their sampling settings, into the next call of
this backend's sampler (:mod:`policy.generation`). Batching and failures: docs/serving.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from nemo_rl_offload.config.generation_settings import SamplingSettings
from nemo_rl_offload.policy.generation import Generated

__all__ = ["GenerateFn", "SamplerClient"]

_LOG = logging.getLogger("nemo_rl_offload.serving")

# The sampler: prompts, their shared settings and a seed -> one Generated per prompt, in order.
GenerateFn = Callable[[list[list[int]], SamplingSettings, int], list[Generated]]

# Seeds of consecutive sampler calls are this far apart (a call's rows draw from one generator).
_SEED_STRIDE = 7919
# The first request to an idle sampler waits for the rest of its burst (an agent framework
# sends a step's rollouts together, over some milliseconds): until no request has come for
# GATHER_QUIET_S, at most GATHER_MAX_S. A burst split over two calls takes nearly twice as
# long, since a call's time is its decode steps whatever its rows (measured on an H100; see
# docs/serving.md); both waits are short against a call.
GATHER_QUIET_S = 0.05
GATHER_MAX_S = 1.0


@dataclass
class _Pending:
    prompt: list[int]
    settings: SamplingSettings
    future: asyncio.Future[dict[str, Any]]


class SamplerClient:
    """``add_request`` for megatron-core's endpoints, backed by ``generate``.

    ``max_len`` is ``policy.max_total_sequence_length`` (prompt and new tokens together);
    ``stop_token_ids`` the recipe's stops besides ``eos_id``; ``vocab_limit`` the tokenizer's
    vocabulary (ids beyond it are never sampled); ``max_batch`` the most requests one sampler
    call takes; ``policy_epoch`` says which weights sampled
    (the training step), reported with every completion as megatron-core's server does.
    """

    def __init__(
        self,
        generate: GenerateFn,
        *,
        decode: Callable[[Sequence[int]], str],
        max_len: int,
        eos_id: int,
        stop_token_ids: Sequence[int] = (),
        vocab_limit: int | None = None,
        seed: int = 0,
        max_batch: int = 64,
        policy_epoch: Callable[[], int] = lambda: 0,
        gather_quiet_s: float = GATHER_QUIET_S,
        gather_max_s: float = GATHER_MAX_S,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self._generate = generate
        self._decode = decode
        self.max_len = int(max_len)
        self._eos_id = int(eos_id)
        self._stops = tuple(int(s) for s in stop_token_ids)
        self._vocab_limit = vocab_limit
        self._seed = int(seed)
        self._max_batch = int(max_batch)
        self._policy_epoch = policy_epoch
        self._gather = (float(gather_quiet_s), float(gather_max_s))
        self._calls = 0
        self._queue: asyncio.Queue[_Pending] | None = None
        self._batcher: asyncio.Task[None] | None = None
        # One sampler call at a time, off the event loop (the policy's calls block).
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "policy-sampler")

    # ------------------------------------------------------------------ the endpoints' API
    async def add_request(self, prompt_tokens: Sequence[int], sampling_params: Any) -> dict:
        """The record of one completion of ``prompt_tokens`` (megatron-core's record keys), or
        a failed record naming what cannot be served."""
        prompt = [int(t) for t in prompt_tokens]
        settings = self.settings_for(prompt, sampling_params)
        if isinstance(settings, str):
            return _failed(settings)
        loop = asyncio.get_running_loop()
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._batcher = loop.create_task(self._run_batches())
        pending = _Pending(prompt, settings, loop.create_future())
        await self._queue.put(pending)
        return await pending.future

    @property
    def waiting(self) -> int:
        """Requests queued for the next sampler call."""
        return 0 if self._queue is None else self._queue.qsize()

    def stop(self) -> None:
        """Cancel the batcher (the server's loop is ending) and let the sampler thread go."""
        if self._batcher is not None:
            self._batcher.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ request -> settings
    def settings_for(self, prompt: list[int], params: Any) -> SamplingSettings | str:
        """The sampler's settings for one request, or the message of why it cannot be served
        (a 400 for the client)."""
        if not prompt:
            return "the prompt is empty: it needs at least one token"
        if self._vocab_limit is not None and not all(0 <= t < self._vocab_limit for t in prompt):
            bad = next(t for t in prompt if not 0 <= t < self._vocab_limit)
            return (
                f"prompt: token id {bad} is outside the vocabulary [0, {self._vocab_limit}) "
                "(in the prompt or an earlier turn's token ids)"
            )
        top_n = int(getattr(params, "top_n_logprobs", 0) or 0)
        if top_n > 0:
            return (
                f"top_logprobs: {top_n} is not served: this sampler returns the log-probability "
                "of each sampled token only; send top_logprobs 0"
            )
        if getattr(params, "return_log_probs", False) and not getattr(
            params, "skip_prompt_log_probs", True
        ):
            return (
                "prompt log-probabilities (echo with logprobs) are not served: this sampler "
                "returns the log-probabilities of the new tokens only; send echo false"
            )
        if getattr(params, "stop_words", None):
            return (
                f"stop: {params.stop_words!r} is not served: this sampler stops at token ids "
                "only (the end-of-sequence token and policy.generation.stop_token_ids); remove "
                "stop"
            )
        wanted = getattr(params, "num_tokens_to_generate", None)
        total = getattr(params, "num_tokens_total", None)
        room = self.max_len - len(prompt)
        if wanted is None and total is not None:
            wanted = int(total) - len(prompt)
        if wanted is not None and int(wanted) < 1:
            return f"max_tokens: {wanted} must be at least 1 (or left out: the rest of the context)"
        new_tokens = room if wanted is None else int(wanted)
        if new_tokens < 1 or new_tokens > room:
            return (
                f"MaxSequenceLengthOverflowError: this model's maximum context length is "
                f"{self.max_len} tokens (policy.max_total_sequence_length); the prompt has "
                f"{len(prompt)} and {new_tokens} more were requested"
            )
        termination = getattr(params, "termination_id", None)
        if termination is None:
            stops = (*self._stops, self._eos_id)
        elif int(termination) < 0:  # ignore_eos
            stops = ()
        else:
            stops = (int(termination),)
        temperature = float(getattr(params, "temperature", 1.0))
        top_k = int(getattr(params, "top_k", 0) or 0)
        top_p = float(getattr(params, "top_p", 0.0) or 0.0)
        greedy = temperature == 0.0 or top_k == 1
        return SamplingSettings(
            max_new_tokens=new_tokens,
            temperature=1.0 if greedy else temperature,
            # megatron-core's 0 means "off" for both.
            top_p=1.0 if greedy or top_p <= 0.0 else top_p,
            top_k=None if greedy or top_k <= 0 else top_k,
            greedy=greedy,
            stop_token_ids=stops,
            vocab_limit=self._vocab_limit,
        )

    # ------------------------------------------------------------------ batching
    async def _run_batches(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            await self._gather_burst()
            while len(batch) < self._max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            for group in _by_settings(batch):
                if not await self._sample(loop, group) and len(group) > 1:
                    for pending in group:  # which request failed it: each alone
                        await self._sample(loop, [pending])

    async def _sample(self, loop: asyncio.AbstractEventLoop, group: list[_Pending]) -> bool:
        """One sampler call for ``group`` (requests of the same settings), resolving each
        request's future; False when the call raised (a lone request's future is then failed,
        several requests' are left for the caller to try one by one)."""
        longest = max(p.settings.max_new_tokens for p in group)
        settings = replace(group[0].settings, max_new_tokens=longest)
        seed = self._seed + _SEED_STRIDE * self._calls
        self._calls += 1
        prompts = [p.prompt for p in group]
        try:
            generated = await loop.run_in_executor(
                self._executor, self._generate, prompts, settings, seed
            )
        except Exception:  # the policy failed this call: logged here, not told to the client
            _LOG.exception(
                "the policy's sampler failed a call of %d request(s) (%s)", len(group), settings
            )
            if len(group) == 1:
                _resolve(group[0].future, _failed("the policy's sampler failed", transient=True))
            return False
        epoch = self._policy_epoch()
        for p, g in zip(group, generated, strict=True):
            _resolve(p.future, self._record(p, g, epoch))
        return True

    async def _gather_burst(self) -> None:
        """Wait while requests keep arriving (at most the cap, or until a call's worth)."""
        assert self._queue is not None
        quiet, cap = self._gather
        if quiet <= 0:
            return
        deadline = asyncio.get_running_loop().time() + cap
        seen = -1
        while seen != self._queue.qsize() and self._queue.qsize() + 1 < self._max_batch:
            seen = self._queue.qsize()
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return
            await asyncio.sleep(min(quiet, remaining))

    def _record(self, pending: _Pending, generated: Generated, epoch: int) -> dict[str, Any]:
        limit = pending.settings.max_new_tokens
        ids = [int(t) for t in generated.ids[:limit]]
        logprobs = [float(x) for x in generated.logprobs[:limit]]
        return {
            "status": "COMPLETED",
            "events": [],
            "prompt_tokens": pending.prompt,
            "prompt_length": len(pending.prompt),
            "generated_tokens": ids,
            "generated_text": self._decode(ids),
            "log_probs": logprobs,
            "generated_log_probs": logprobs,
            "generated_top_n_logprobs": None,
            "prompt_log_probs": None,
            "prompt_top_n_logprobs": None,
            # A stop token ends a row before its limit; the endpoints call a full row "length".
            "sampling_params": {"num_tokens_to_generate": limit},
            "num_cached_tokens": 0,
            "policy_epoch": epoch,
            "kv_cache_epoch": epoch,
            # policy.router_replay: the experts of the prompt's and the kept tokens' positions
            # (-1 where no forward fed one: the last token), as nested lists for JSON.
            "routing_indices": (
                None
                if generated.routes is None
                else generated.routes[: len(pending.prompt) + len(ids)].tolist()
            ),
        }


def _by_settings(batch: list[_Pending]) -> list[list[_Pending]]:
    """Requests grouped by everything but their token limit, in arrival order."""
    groups: dict[SamplingSettings, list[_Pending]] = {}
    for pending in batch:
        key = replace(pending.settings, max_new_tokens=1)
        groups.setdefault(key, []).append(pending)
    return list(groups.values())


def _resolve(future: asyncio.Future[dict[str, Any]], record: dict[str, Any]) -> None:
    if not future.done():  # the client may have gone (a cancelled request)
        future.set_result(record)


def _failed(message: str, *, transient: bool = False) -> dict[str, Any]:
    """megatron-core's failed record: its endpoints answer 400 for a non-transient error."""
    kind = "ERROR_TRANSIENT" if transient else "ERROR_NONTRANSIENT"
    return {"status": "FAILED", "events": [{"type": kind, "payload": message}]}
