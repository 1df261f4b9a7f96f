"""From a validated HTTP body to generated text: limits, admission, per-choice streams, stop strings, timeouts.

`ServingCore` turns prompts into `Job`s (token ids, max_tokens, sampling, stops), checked against the
model's context and the server's limits with errors naming the offending field; and runs each job as a
stream of `Piece`s (text delta, token, logprob, finish reason) over the `Backend`. A job that ends early for
any reason (stop string, timeout, client gone, error) is aborted on the gang so its slot is freed on every
host.

`Limits` is the one statement of what the deployment accepts, and `ServingCore` the one place that enforces
it: the context and max_tokens checks, and admission: at most `max_slots` per ready gang plus `max_queue`
sequences at once; the requests beyond wait at the ingress in a bounded first-come-first-served line
(`max_waiting` requests, `queue_wait_s` each, then 503 + Retry-After; raydeploy.serve.limits.CapacityQueue).
Below it nothing refuses or queues on its own account: each gang replica takes `max_slots` requests (Serve's
`max_ongoing_requests`), so a gang's own queue stays empty, and the admitted requests beyond the free slots
wait in Serve's router for the first free slot of any gang (raydeploy.serve.deployment).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from raydeploy.config import Config
from raydeploy.constraints.spec import Constraint
from raydeploy.engine.geometry import AdmissionLimits
from raydeploy.engine.request import GenerationRequest, PromptTokenLogprob
from raydeploy.engine.step import SamplingParams
from raydeploy.gang.coordinator import ADAPTER_UNKNOWN
from raydeploy.serve.backend import Backend
from raydeploy.serve.errors import (
    APIError,
    InternalError,
    InvalidRequest,
    RequestTimeout,
    ServiceUnavailable,
)
from raydeploy.serve.limits import Admission, CapacityQueue, queue_wait_s, request_scope
from raydeploy.serve.metrics import ServingMetrics
from raydeploy.serve.text import StopMatcher, TextCodec

log = logging.getLogger("raydeploy.serve")

@dataclass(frozen=True)
class Limits:
    """What the deployment accepts: computed once from the config (the numbers the plan sizes each gang by)."""

    model_name: str
    max_seq_len: int
    max_new_tokens: int | None
    """The operator's cap on tokens generated per request (`engine.max_new_tokens`); None: the context is the
    only bound."""
    max_slots: int
    max_queue: int
    request_timeout_s: float
    default_sampling: SamplingParams
    max_waiting: int = 2048
    """Requests that may wait for room beyond the capacity (serving.max_waiting)."""
    queue_wait_s: float = 300.0
    """Seconds a request may wait for room (serving.queue_wait_s, or the request timeout)."""
    lora: bool = False
    """The gangs serve LoRA adapters (lora.max_adapters > 0): another `model` than the base model's names one."""

    @classmethod
    def from_config(cls, cfg: Config, model_name: str) -> Limits:
        """The engine's admission limits (`EngineGeometry.admission`, from the config alone) and the serving ones."""
        s, admits = cfg.engine.sampling, AdmissionLimits.from_config(cfg)
        return cls(model_name=model_name, max_seq_len=admits.max_seq_len,
                   max_new_tokens=admits.max_new_tokens, max_slots=admits.max_slots,
                   max_queue=cfg.serving.max_queue, request_timeout_s=cfg.serving.request_timeout_s,
                   default_sampling=SamplingParams(s.temperature, s.top_p, s.top_k, s.repetition_penalty, 0),
                   max_waiting=cfg.serving.max_waiting, queue_wait_s=queue_wait_s(cfg),
                   lora=cfg.lora.max_adapters > 0)


@dataclass
class Job:
    """One choice of one request, ready for the gang."""

    index: int
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    timeout_s: float = 300.0
    request_id: str = ""
    constraint: Constraint | None = None
    """What the generated text must match (structured outputs, a forced tool call); checked already."""
    include_stop_str: bool = False
    """The stop string that ended the text stays at its end (`include_stop_str_in_output`)."""
    skip_special_tokens: bool = True
    """Special tokens are left out of the text (the tokens themselves still count and carry logprobs)."""
    top_logprobs: int = 0
    """Alternatives per generated token (0..20: `GenerationRequest.top_logprobs`)."""
    prompt_logprobs: int | None = None
    """The prompt tokens' logprobs with this many alternatives (None: none; `echo` and vLLM's `prompt_logprobs`)."""
    logprobs: bool = False
    """The response reports logprobs: the stop token that ends the text is reported too (and counted), as vLLM's."""
    adapter: str | None = None
    """The LoRA adapter the job runs under (`GenerationRequest.adapter`); None: the base model."""


@dataclass
class Piece:
    """What a job produced at one event: text to emit (may be empty), the token, and the end if it ended."""

    text: str
    token_id: int | None = None
    logprob: float | None = None
    finish_reason: str | None = None
    cached_tokens: int | None = None
    """On a job's first piece: its prompt tokens the gang found in the prefix cache (`TokenEvent.cached_tokens`)."""
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    """With the token, when the job asked: (token id, logprob) of the most likely tokens, descending."""
    prompt_logprobs: tuple[PromptTokenLogprob | None, ...] | None = None
    """On a job's first piece, when it asked: per prompt token, its logprob, rank and alternatives (None first)."""


@dataclass
class Choice:
    """A finished job (for non-streaming answers)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float | None]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int | None = None
    """Prompt tokens the gang found in the prefix cache."""
    top_logprobs: list[tuple[tuple[int, float], ...] | None] = field(default_factory=list)
    """Per generated token, its alternatives (None where the job asked for none)."""
    prompt_logprobs: tuple[PromptTokenLogprob | None, ...] | None = None
    """Per prompt token, when the job asked (`Job.prompt_logprobs`)."""


class ServingCore:
    def __init__(self, backend: Backend, codec: TextCodec, limits: Limits,
                 metrics: ServingMetrics | None = None) -> None:
        self.backend = backend
        self.codec = codec
        self.limits = limits
        self.metrics = metrics or ServingMetrics()
        self.metrics.set_model_name(limits.model_name)
        self.queue = CapacityQueue(limits.max_waiting, limits.queue_wait_s)
        """Admission: sequences in flight against the capacity, and the requests waiting for room."""
        self._background: set[asyncio.Task] = set()

    # -- building jobs ---------------------------------------------------------------------------------
    def sampling(self, *, temperature: float | None, top_p: float | None, top_k: int | None,
                 repetition_penalty: float | None, seed: int | None, presence_penalty: float | None = None,
                 frequency_penalty: float | None = None, min_p: float | None = None,
                 logit_bias: Mapping[int, float] | None = None, min_tokens: int | None = None) -> SamplingParams:
        """A request's sampling: the fields it sets over `engine.sampling` (`SamplingParams.resolve`, as every
        command); a negative top_k is 0 (off), and a request without a seed gets a random one. The OpenAI
        controls (penalties, min_p, logit_bias, min_tokens) pass through by name, None where the request leaves
        them out (neutral); a value outside what the engine honours is resolve's ValueError naming the field."""
        return SamplingParams.resolve(self.limits.default_sampling, temperature=temperature, top_p=top_p,
                                      top_k=None if top_k is None else max(0, int(top_k)),
                                      repetition_penalty=repetition_penalty,
                                      seed=random.randrange(2**31) if seed is None else int(seed),
                                      presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                      min_p=min_p, logit_bias=logit_bias, min_tokens=min_tokens)

    def check_model(self, model: str | None, adapters: Collection[str] = ()) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model); 404 naming it when it is neither
        the base model nor one of `adapters` (the gangs' known adapters, `raydeploy.serve.routes.lora`)."""
        from raydeploy.serve.errors import ModelNotFound

        if model is None or model == self.limits.model_name:
            return None
        if model in adapters:
            return model
        raise ModelNotFound(model, self.limits.model_name)

    def max_tokens_for(self, prompt_len: int, max_tokens: int | None, *, prompt_param: str,
                       max_param: str = "max_tokens", default: int | None = None) -> int:
        """The tokens a job may generate. The one rule: the prompt plus `max_tokens` must fit the context (a 400
        naming both numbers otherwise), and `max_tokens` may not pass the operator's cap `engine.max_new_tokens`
        when one is set. Left out, it is `default` (completions: OpenAI's 16), or else as many as the context
        leaves (a stop or the end of the context ends the answer), within the cap."""
        lim = self.limits
        if prompt_len == 0:
            raise InvalidRequest(f"'{prompt_param}' must not be empty", param=prompt_param, code="empty_prompt")
        if prompt_len >= lim.max_seq_len:
            raise InvalidRequest(
                f"'{prompt_param}' is {prompt_len} tokens; this model's context is {lim.max_seq_len} tokens "
                f"and at least one must be left for the answer", param=prompt_param, code="context_length_exceeded")
        room = lim.max_seq_len - prompt_len
        cap = lim.max_new_tokens if lim.max_new_tokens is not None else room
        if max_tokens is None:
            return min(default if default is not None else room, cap, room)
        if lim.max_new_tokens is not None and max_tokens > lim.max_new_tokens:
            raise InvalidRequest(
                f"'{max_param}' is {max_tokens}; this server generates at most {lim.max_new_tokens} tokens "
                f"per request (engine.max_new_tokens)", param=max_param, code="invalid_value")
        if max_tokens > room:
            raise InvalidRequest(
                f"the prompt ({prompt_len} tokens) plus '{max_param}' ({max_tokens}) is "
                f"{prompt_len + max_tokens} tokens, over this model's context of {lim.max_seq_len} tokens",
                param=max_param, code="context_length_exceeded")
        return max_tokens

    def timeout_for(self, timeout_s: float | None) -> float:
        t = self.limits.request_timeout_s
        return t if timeout_s is None else min(t, float(timeout_s))

    # -- admission -----------------------------------------------------------------------------------
    async def admit(self, n_jobs: int) -> Admission:
        """Reserve room for `n_jobs`: `max_slots` per ready gang plus `max_queue` (`capacity`); beyond it the
        request waits in line, first come first served, at most `queue_wait_s` and behind at most `max_waiting`
        others, before a 503 with Retry-After (raydeploy.serve.limits.CapacityQueue); a request that could never
        fit is a 400. The returned ticket gives the room back once, whoever releases it first (the stream's end,
        the response's close, the request's scope in the front door, or garbage collection as a last resort)."""
        lim = self.limits
        if n_jobs > lim.max_slots + lim.max_queue:  # could never be admitted: not a retriable 503
            raise InvalidRequest(f"the request asks for {n_jobs} sequences (n times the prompts); this server "
                                 f"holds at most {lim.max_slots + lim.max_queue} at once ({lim.max_slots} slots "
                                 f"and {lim.max_queue} queued)", param="n", code="invalid_value")
        scope = request_scope()
        self.metrics.line.inc(n_jobs)  # vllm:num_requests_waiting counts the line too
        try:
            return await self.queue.take(n_jobs, self.capacity, scope.client_gone if scope is not None else None)
        finally:
            self.metrics.line.dec(n_jobs)

    async def capacity(self) -> int:
        """Sequences admitted at once: `max_slots` per ready gang (one while none is: its requests then get the
        gang's own answer) plus `max_queue`, the admitted requests that wait in Serve's router for a free slot."""
        gangs = max(1, int((await self.backend.state()).get("ready_gangs") or 0))
        return self.limits.max_slots * gangs + self.limits.max_queue

    def release(self, ticket: Admission) -> None:
        """Give a ticket's room back (idempotent: a released ticket counts once)."""
        ticket.release()

    @property
    def in_flight(self) -> int:
        """Sequences admitted and not yet released."""
        return self.queue.in_flight

    @property
    def waiting(self) -> int:
        """Requests waiting for room now."""
        return self.queue.waiting

    # -- running ---------------------------------------------------------------------------------------
    async def pieces(self, job: Job, arrived_s: float) -> AsyncGenerator[Piece, None]:
        """Stream one job, a piece at a time (`batches`, flattened)."""
        batches = self.batches(job, arrived_s)
        try:
            async for batch in batches:
                for piece in batch:
                    yield piece
        finally:
            await batches.aclose()

    async def batches(self, job: Job, arrived_s: float) -> AsyncGenerator[list[Piece], None]:
        """Stream one job: the pieces of each batch of token events the gang sent at once (a plan's tokens), so a
        stream writes them in one response message. Raises APIError subclasses only; always frees the gang slot
        if it ends early."""
        # max_tokens 0 (echo of the prompt and its logprobs only): the gang draws one token, which is dropped
        prompt_only = job.max_tokens == 0
        req = GenerationRequest(request_id=job.request_id, prompt_token_ids=tuple(job.prompt_ids),
                                max_tokens=max(1, job.max_tokens), sampling=job.sampling,
                                stop_token_ids=tuple(job.stop_token_ids), ignore_eos=job.ignore_eos,
                                constraint=job.constraint, top_logprobs=job.top_logprobs,
                                prompt_logprobs=job.prompt_logprobs, report_stop=job.logprobs, adapter=job.adapter)
        first: dict[str, Any] | None = None  # what the first event brought, for the first piece
        end_ids = set(job.stop_token_ids) | (set() if job.ignore_eos else set(self.codec.eos_token_ids))
        detok = self.codec.detokenizer(job.skip_special_tokens)
        stopper = StopMatcher(job.stop, job.include_stop_str)
        self.metrics.started()
        n_out, first_at, finished, done_in_gang = 0, None, False, False
        last_at, end = 0.0, "abort"  # the metrics' view: last tokens' arrival, finished_reason
        deadline = arrived_s + job.timeout_s
        stream = self.backend.generate(req)
        try:
            while True:
                remaining_s = deadline - time.perf_counter()
                if remaining_s <= 0:
                    raise RequestTimeout(job.timeout_s)
                try:
                    # A deadline per wait, not around the yields: the consumer's own awaits stay its own.
                    async with asyncio.timeout(remaining_s):
                        events = await anext(stream)
                except StopAsyncIteration:
                    done_in_gang = True
                    raise ServiceUnavailable("the model gang ended the stream early; retry shortly", 1.0) from None
                except TimeoutError:
                    raise RequestTimeout(job.timeout_s) from None
                if arrived := sum(ev.token_id is not None for ev in events):
                    now = time.perf_counter()
                    self.metrics.tokens_arrived(arrived, None if first_at is None else now - last_at)
                    last_at = now
                out: list[Piece] = []
                for ev in events:
                    if ev.finish_reason == "error":
                        done_in_gang = True
                        raise _event_error(ev)
                    more: dict[str, Any] = {"top_logprobs": ev.top_logprobs}
                    if first is None:  # the job's first piece carries what its first event brought
                        first = {"cached_tokens": ev.cached_tokens, "prompt_logprobs": ev.prompt_logprobs}
                        more.update(first)
                    if prompt_only:
                        done_in_gang = ev.finish_reason is not None
                        finished, end = True, "length"
                        yield [Piece("", None, None, "length", **first)]
                        return
                    text = ""
                    if ev.token_id is not None:
                        n_out += 1
                        if first_at is None:
                            first_at = time.perf_counter()
                            self.metrics.first_token(first_at - arrived_s)
                        is_end_token = ev.finish_reason == "stop" and ev.token_id in end_ids
                        text = "" if is_end_token else stopper.feed(detok.add(ev.token_id),
                                                                    armed=n_out >= job.sampling.min_tokens)
                        if stopper.stopped:
                            finished, end = True, "stop"
                            out.append(Piece(text, ev.token_id, ev.logprob, "stop", **more))
                            yield out
                            return
                        if ev.finish_reason is None:
                            out.append(Piece(text, ev.token_id, ev.logprob, **more))
                            continue
                    if ev.finish_reason is not None:
                        done_in_gang = finished = True
                        if ev.finish_reason == "abort":
                            raise ServiceUnavailable("the request was aborted by the server; retry shortly", 1.0)
                        tail = stopper.feed(detok.flush())
                        tail += "" if stopper.stopped else stopper.finish()
                        reason = "stop" if (stopper.stopped or ev.finish_reason == "stop") else ev.finish_reason
                        out.append(Piece(text + tail, ev.token_id, ev.logprob, reason, **more))
                        end = reason
                        yield out
                        return
                if out:
                    yield out
        except APIError as e:
            if not isinstance(e, RequestTimeout | ServiceUnavailable):  # those two are aborts, as in vLLM
                end = "error"
            raise
        except Exception as e:  # anything else from the gang: logged in full, answered as a generic 500
            end = "error"
            log.error("request %s failed", job.request_id, exc_info=e)
            raise InternalError() from None
        finally:
            now = time.perf_counter()
            self.metrics.finished(got_first_token=first_at is not None, prompt_tokens=len(job.prompt_ids),
                                  output_tokens=n_out, duration_s=now - arrived_s,
                                  decode_s=(now - first_at) if first_at is not None else 0.0, finish_reason=end)
            if not (finished and done_in_gang):
                self._abort_soon(job.request_id)
            await _close(stream)

    def _abort_soon(self, request_id: str) -> None:
        """Free the request's slot on the gang, even from a cancelled task (client disconnect)."""

        async def _abort() -> None:
            try:
                await self.backend.abort(request_id)
            except Exception as e:  # the gang may be restarting; its slots are gone then anyway
                log.warning("abort of %s failed: %s", request_id, type(e).__name__)

        task = asyncio.get_running_loop().create_task(_abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def run(self, job: Job, arrived_s: float) -> Choice:
        text, ids, lps, tops, reason, cached, prompt_lps = [], [], [], [], "length", None, None
        async for p in self.pieces(job, arrived_s):
            text.append(p.text)
            if p.cached_tokens is not None:
                cached = p.cached_tokens
            if p.prompt_logprobs is not None:
                prompt_lps = p.prompt_logprobs
            if p.token_id is not None:
                ids.append(p.token_id)
                lps.append(p.logprob)
                tops.append(p.top_logprobs)
            if p.finish_reason:
                reason = p.finish_reason
        return Choice(job.index, "".join(text), ids, lps, reason, len(job.prompt_ids), cached, tops, prompt_lps)

    async def run_all(self, jobs: Sequence[Job], arrived_s: float) -> list[Choice]:
        """All jobs concurrently (they batch together on the gang); the first failure cancels the rest."""
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self.run(j, arrived_s)) for j in jobs]
        except BaseExceptionGroup as eg:
            raise _first_error(eg) from None
        return [t.result() for t in tasks]

    async def merged(self, jobs: Sequence[Job], arrived_s: float) -> AsyncGenerator[tuple[int, list[Piece]], None]:
        """Batches of pieces (`batches`) of several jobs as they come, tagged with the job's index."""
        if len(jobs) == 1:
            one = self.batches(jobs[0], arrived_s)
            try:
                async for p in one:
                    yield jobs[0].index, p
            finally:
                await one.aclose()  # now, not at garbage collection: a client gone frees its slot at once
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(job: Job) -> None:
            try:
                async for p in self.batches(job, arrived_s):
                    await queue.put((job.index, p))
            except APIError as e:
                await queue.put(e)
            finally:
                await queue.put(done)

        tasks = [asyncio.get_running_loop().create_task(pump(j)) for j in jobs]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, APIError):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()


async def _close(stream: AsyncIterator) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _event_error(ev) -> APIError:
    """The HTTP error of a gang's error event: 503 for a gang failure (retriable); for a request the engine failed
    on its own (not retried), 400 with the engine's reason when the request's content is at fault (the engine's
    own checks word it: a token id and the vocabulary size), else a 500 naming the request (details in the log)."""
    from raydeploy.serve.errors import InvalidRequest, NotFound, RequestFailedError

    if ev.retriable:
        return ServiceUnavailable("the model gang failed during the request and is restarting; retry shortly")
    log.error("request %s failed in the gang: %s", ev.request_id, ev.error)
    if getattr(ev, "invalid", False) and ev.error and ev.error.startswith(ADAPTER_UNKNOWN + ": "):
        return NotFound(ev.error.removeprefix(ADAPTER_UNKNOWN + ": "), param="model", code="model_not_found")
    if getattr(ev, "invalid", False) and ev.error:
        return InvalidRequest(ev.error, code="invalid_value")
    return RequestFailedError(f"request {ev.request_id} failed in the model engine and was not retried; the details "
                              f"are in the server log", code="request_failed")


def _first_error(eg: BaseExceptionGroup) -> BaseException:
    for e in eg.exceptions:
        if isinstance(e, BaseExceptionGroup):
            return _first_error(e)
        if isinstance(e, APIError):
            return e
    return eg.exceptions[0]
