"""``specdecode serve``: an OpenAI-compatible HTTP server over the batched engine.

One engine thread runs ``BatchEngine.step`` while there is work; request handlers queue
sequences and read their outputs through an asyncio queue fed from that thread. Routes:
POST /v1/completions and /v1/chat/completions (with and without ``stream``), GET
/v1/models, /health and /metrics. Errors are OpenAI's JSON
``{"error": {"message", "type", "param", "code"}}``; no stack trace reaches a client.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import MAX_SERVED_K, VLLM_METHODS, ConfigError, SamplingParams, SpecDecodeError
from ..engine import ContextLengthError, PromptError
from ..metrics import GenerationStats
from ..text import decode, not_utf8
from .batch import BatchEngine, Sequence, StepOutput
from .metrics import LabelledRegistry, ServerMetrics

logger = logging.getLogger("specdecode.serve")
# which process (replica) answered: the host too, as replicas on other nodes (or in other
# containers) may have the same pid (found in review)
FINGERPRINT = f"specdecode-{socket.gethostname()}-{os.getpid()}"


# -- errors ------------------------------------------------------------------------------
class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code, self.headers)


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


# -- requests ----------------------------------------------------------------------------
# Integers and booleans are taken as JSON gives them (StrictInt, StrictBool), as OpenAI's
# API does: lax parsing turned "max_tokens": true into 1 token, [true, 5] into token ids and
# "stream": "yes" into a stream (found in review). Floats stay lax, so "temperature": 1
# still reads as 1.0.


class SpeculativeOptions(BaseModel):
    """Per-request speculation (the openai client's ``extra_body={"speculative": ...}``)."""

    model_config = ConfigDict(extra="forbid")
    enabled: StrictBool = True
    method: str | None = None
    num_speculative_tokens: StrictInt | Literal["auto"] | None = None

    @field_validator("num_speculative_tokens")
    @classmethod
    def _positive(cls, value):
        if isinstance(value, int) and not 1 <= value <= MAX_SERVED_K:
            raise ValueError(f"num_speculative_tokens must be 'auto' or an integer in 1..{MAX_SERVED_K}")
        return value

    @model_validator(mode="after")
    def _nothing_ignored(self):
        # found in review: each ran, the values unread ({"enabled": false, "method": "hydra"}
        # too), as --speculative-config refuses them
        if self.method is not None and not self.method:
            raise ValueError("method must name a speculative method")
        if not self.enabled and (self.method is not None or self.num_speculative_tokens is not None):
            raise ValueError("enabled false decodes plainly: method and num_speculative_tokens would be ignored")
        if self.method == "none" and self.num_speculative_tokens is not None:
            raise ValueError("method 'none' decodes plainly: num_speculative_tokens would be ignored")
        return self


# Parameters of OpenAI's API (and vLLM's) that this server does not implement, with what
# each may hold (its default, or asking for nothing): a request that sends the default still
# runs, any other value is refused by name (accepted and ignored, it would give a silently
# different answer)
UNSUPPORTED_DEFAULTS = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "logit_bias": (None, {}),
    "frequency_penalty": (None, 0), "presence_penalty": (None, 0), "repetition_penalty": (None, 1),
    "min_p": (None, 0), "min_tokens": (None, 0), "best_of": (None, 1), "response_format": (None, {"type": "text"}),
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
    "function_call": (None, "none", "auto"), "prediction": (None,), "prompt_logprobs": (None,),
    # vLLM's own sampling and output parameters
    "stop_token_ids": (None, []), "include_stop_str_in_output": (None, False), "allowed_token_ids": (None, []),
    "bad_words": (None, []), "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
    "use_beam_search": (None, False), "length_penalty": (None, 1), "truncate_prompt_tokens": (None,),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "guided_decoding_backend": (None,), "structured_outputs": (None,), "logits_processors": (None, []),
    "add_generation_prompt": (None, True), "continue_final_message": (None, False), "chat_template": (None,),
    "chat_template_kwargs": (None, {}), "documents": (None, []),
    # found in review, each accepted and ignored: vLLM's priority scheduling and prompt
    # embeddings, OpenAI's audio output and reasoning effort
    "priority": (None, 0), "prompt_embeds": (None,), "modalities": (None, ["text"]), "audio": (None,),
    "reasoning_effort": (None,), "verbosity": (None,), "web_search_options": (None,),
    # vLLM's, refused by name since unknown keys are (found in review: echo on chat, its
    # disaggregated-prefill and extension arguments)
    "echo": (None, False), "suffix": (None,), "kv_transfer_params": (None, {}), "vllm_xargs": (None, {}),
    "mm_processor_kwargs": (None, {}), "media_io_kwargs": (None, {}), "structural_tag": (None,),
    "guided_whitespace_pattern": (None,),
}


# Keys OpenAI's API or vLLM's takes that change nothing in the answer here, so a request
# that sends them runs. Any other key this server does not declare is refused by name: a
# misspelt "temprature" or "max_new_tokens" used to run with the default (found in review).
IGNORED_KEYS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
                "safety_identifier", "request_id",
                # vLLM's: reasoning output (this model has none) and logprobs' token format (logprobs are refused)
                "include_reasoning", "return_tokens_as_token_ids"}


def client_request_id(request: Request, body) -> str:
    """The response id's base as vLLM makes it: the X-Request-Id header, else the body's
    ``request_id``, else a random one (found in review: both were ignored). It also names the
    request in the server's log lines, so it must be printable text of at most 256 characters."""
    given = request.headers.get("X-Request-Id") or (body.model_extra or {}).get("request_id")
    if given is None or given == "":
        return uuid.uuid4().hex[:24]
    if not isinstance(given, str) or not given.isprintable() or not 0 < len(given) <= 256:
        raise APIError(400, "request_id (or the X-Request-Id header) must be printable text of 1 to 256 characters",
                       param="request_id")
    return given


def _is_default(value, defaults: tuple) -> bool:
    """``value`` is one of ``defaults``, a bool only where a bool is: ``logprobs: 0`` asks
    for the chosen tokens' logprobs in OpenAI's completions, yet ``0 == False``."""
    return any(value is d or (isinstance(value, bool) == isinstance(d, bool) and value == d) for d in defaults)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an option not known here is refused, not ignored
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False  # vLLM's; refused when true (sampling())


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept in model_extra: UNSUPPORTED_DEFAULTS reads them
    model: str | None = None
    # JSON numbers only (found in review: false and "0" were read as greedy, true as 1.0)
    # NaN and Infinity, which Python's JSON parser takes, are named as such (found in review: "should be <= 2")
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: StrictInt | None = Field(default=None, ge=-1)
    stop: str | list[str] | None = None
    seed: StrictInt | None = Field(default=None, ge=-(2 ** 63), le=2 ** 63 - 1)
    # null means the default for these, as in OpenAI's schema and vLLM (found in review:
    # an explicit null was a 400)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = Field(default=1, ge=1)
    ignore_eos: StrictBool | None = False
    speculative: SpeculativeOptions | None = None
    task_type: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1)  # vLLM's: prefix reuse only within one salt
    # vLLM's: the prompt's and each choice's token ids beside the text (always for a model
    # without a tokenizer, whose text is empty: its tokens were lost; found in review)
    return_token_ids: StrictBool | None = False

    @model_validator(mode="after")
    def _defaults_for_null(self):
        self.stream, self.n, self.ignore_eos = bool(self.stream), self.n or 1, bool(self.ignore_eos)
        self.return_token_ids = bool(self.return_token_ids)
        if "echo" in type(self).model_fields:
            self.echo = bool(self.echo)
        return self

    def sampling(self, max_tokens: int, model_defaults: dict | None = None) -> SamplingParams:
        """The request's sampling parameters; ``model_defaults``: the model's own for those it
        leaves out (temperature, top_p, top_k from its generation_config.json, as vLLM)."""
        extra = self.model_extra or {}  # the keys this model does not declare
        unknown = sorted(key for key, value in extra.items()  # null asks for nothing, as everywhere
                         if value is not None and key not in UNSUPPORTED_DEFAULTS and key not in IGNORED_KEYS)
        if unknown:
            raise APIError(400, f"unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
        for name, defaults in UNSUPPORTED_DEFAULTS.items():
            if not _is_default(extra.get(name), defaults):
                raise APIError(400, f"{name} is not supported by this server (only its default)", param=name)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise APIError(400, "stream_options.continuous_usage_stats is not supported by this server",
                           param="stream_options")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stop):
            raise APIError(400, "stop strings must be non-empty", param="stop")
        if len(stop) > 4:
            raise APIError(400, "at most 4 stop strings", param="stop")
        model_defaults = model_defaults or {}
        chosen = {name: model_defaults.get(name, default) if getattr(self, name) is None else getattr(self, name)
                  for name, default in (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0))}
        try:
            return SamplingParams(temperature=chosen["temperature"], top_p=chosen["top_p"],
                                  top_k=max(chosen["top_k"], 0), max_new_tokens=max_tokens, stop=tuple(stop),
                                  seed=self.seed, ignore_eos=self.ignore_eos)
        except ConfigError as error:  # a stop string that is not UTF-8 text (found in review: a 500)
            raise APIError(400, str(error), param="stop" if "stop" in str(error) else None) from None


class CompletionRequest(_Common):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(default=16, ge=1)
    echo: StrictBool | None = False  # the prompt's text before the completion
    suffix: str | None = None
    # vLLM's: whether the tokenizer adds its special tokens (a BOS) to a text prompt
    add_special_tokens: StrictBool | None = True


def _parsed_arguments(call: dict) -> dict:
    """A tool call as chat templates take it: OpenAI's API sends ``function.arguments`` as a
    JSON string, and templates (Qwen2.5's, Llama 3.1's) read a mapping, so vLLM parses it
    first (an empty one is {}). Found in review: handed over as the string, a template that
    writes ``arguments | tojson`` showed the model double-encoded JSON."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"]) if function["arguments"].strip() else {}
    except (ValueError, RecursionError) as error:  # nested 100,000 deep: RecursionError, then a 500 (found in review)
        raise APIError(400, f"a tool call's function.arguments is not valid JSON: {error}", param="messages") from None
    return {**call, "function": {**function, "arguments": arguments}}


# Keys of a message that OpenAI's client writes into an assistant reply (``message.model_dump()``
# sent back as history) or vLLM's reasoning field: none changes what the template shows here.
MESSAGE_IGNORED = {"annotations", "reasoning_content", "reasoning"}


class ChatMessage(BaseModel):
    # a key not known here is refused unless null: {"contents": ...} was read as an empty
    # message (found in review), while a reply sent back carries audio/function_call as null
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None
    refusal: str | None = None  # an assistant message sent back as OpenAI wrote it; not the template's
    # handed to the chat template as vLLM does, tool calls' arguments parsed (found in
    # review: dropped, so the model read another conversation than the client's)
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_given(self):
        for key, value in (self.model_extra or {}).items():
            if value is None or key in MESSAGE_IGNORED:
                continue
            if key in ("audio", "function_call"):
                raise ValueError(f"a message's {key} is not supported by this server")
            raise ValueError(f"unrecognized message key {key!r}")
        # as OpenAI: only an assistant message that calls tools (or refused) may come without content
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.refusal is not None)):
            raise ValueError(f"a {self.role} message needs content")
        if isinstance(self.content, list) and not self.content:  # found in review: read as an empty turn
            raise ValueError(f"a {self.role} message's content parts are empty (give at least one)")
        return self

    def for_template(self) -> dict:
        message = {"role": self.role if self.role != "developer" else "system", "content": self.text()}
        message.update({key: value for key in ("name", "tool_calls", "tool_call_id")
                        if (value := getattr(self, key)) is not None})
        if self.tool_calls is not None:
            message["tool_calls"] = [_parsed_arguments(call) for call in self.tool_calls]
        return message

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, "only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "\n".join(parts)  # as vLLM joins a message's text parts


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    # vLLM's; the chat template writes the special tokens, so only its default (false) runs
    add_special_tokens: StrictBool | None = False


# -- the engine thread -------------------------------------------------------------------
def _is_audit(sequence: Sequence) -> bool:
    """Whether ``sequence`` is an audit's plain re-run (serve/audit.py), not a user request."""
    return sequence.audit_of is not None


@dataclass
class ServerState:
    engine: BatchEngine
    model_name: str
    metrics: ServerMetrics
    speculation: "SpeculationChoices"
    max_queued_requests: int = 64
    api_key: str | None = None
    audit_rate: float = 0.0
    accepting: bool = True
    stopped: bool = False
    wakeup: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    auditor: Any = None
    tokenizer: Any = None
    # temperature, top_p and top_k for a request that leaves them out: the model's
    # generation_config.json, as vLLM's --generation-config auto (serve.server.sampling_defaults)
    sampling_defaults: dict = field(default_factory=dict)
    # audits start only after the engine has had nothing to do this long: in the few
    # milliseconds between a client's requests they ran inside its traffic (found in review:
    # bench-serve's speculative levels timed 4 audits' re-runs, its plain levels none)
    audit_idle_s: float = 0.1

    def start(self) -> None:
        if self.thread is not None:
            return
        self.thread = threading.Thread(target=self._loop, name="specdecode-engine", daemon=True)
        self.thread.start()

    def engine_stopped(self) -> bool:
        """Whether the engine thread has died (it never should: it catches a step's errors)."""
        return self.thread is not None and not self.thread.is_alive()

    def stop(self) -> None:
        self.stopped = True
        self.wakeup.set()
        if self.thread is not None:
            self.thread.join(timeout=30)

    def _loop(self) -> None:
        engine = self.engine
        idle_since = None
        while not self.stopped:
            if not engine.has_work:
                idle_since = idle_since or time.perf_counter()
                try:  # an audit that cannot start must not end the thread (every request would hang)
                    if (self.auditor is not None and time.perf_counter() - idle_since >= self.audit_idle_s
                            and self.auditor.run_one()):
                        continue
                except Exception:
                    logger.exception("starting an audit failed")
                self.wakeup.wait(0.05 if self.auditor is None else min(0.05, self.audit_idle_s))
                self.wakeup.clear()
                continue
            if not all(_is_audit(s) for s in list(engine.running) + list(engine.waiting)):
                idle_since = None  # user traffic: the next audit waits for a quiet spell again
            self._preempt_audits()
            try:
                finished = engine.step()
            except Exception as error:  # never let the thread die: fail the batch, keep serving
                logger.exception("engine step failed; aborting the running requests")
                # our own errors name their cause (NaN logits from an overflowing model):
                # the clients are told it; anything else stays an internal error
                finished = self._fail_all(str(error) if isinstance(error, SpecDecodeError) else None)
            # found in review: a failure from here on ended the thread, and requests in flight waited forever
            try:
                self._report_queue()
                self._count_tokens(list(engine.running) + finished)
                if engine.decode_threads is not None:
                    self.metrics.kernel_threads(engine.decode_threads.preferred)
            except Exception:
                logger.exception("counting an engine step for /metrics failed")
            for sequence in finished:  # those whose listener has not reported them (audits, failures)
                try:
                    self._report(sequence)
                except Exception:
                    logger.exception("reporting a finished request failed")
            try:
                self._report_audits()
            except Exception:
                logger.exception("reporting the audits failed")

    def _report_audits(self) -> None:
        """Audits waiting or re-running, for /metrics (bench-serve waits for none before it
        times a level)."""
        if self.auditor is not None:
            engine = self.engine
            running = sum(_is_audit(s) and not s.finished for s in list(engine.running) + list(engine.waiting))
            self.metrics.labels(self.metrics.audit_pending).set(len(self.auditor.backlog) + running)

    def _report(self, sequence: Sequence) -> None:
        """A finished sequence's metrics, router lesson and audit offer, once. A request's
        listener calls this before handing the client its last output, so /metrics counts a
        request its client saw finish (they were reported after the step, and a client that
        read /metrics on its response found its request missing; found in a flaky test)."""
        if sequence.reported:
            return
        sequence.reported = True
        try:  # reports and the audit: a failure there must not stop decoding either
            self._finished(sequence)
        except Exception:
            logger.exception("reporting finished request %s failed", sequence.request_id)

    def _report_queue(self) -> None:
        """The running and waiting gauges: user requests only (the audit's plain re-runs
        are not traffic), from the engine thread and from each submission (which reads a copy
        of the engine's lists: the engine thread may change them meanwhile)."""
        user = lambda sequences: sum(not _is_audit(s) and not s.finished for s in list(sequences))  # noqa: E731
        engine = self.engine
        # every row holds max_model_len token slots, held by the running sequences' tokens
        held = sum(len(s.tokens) for s in list(engine.running) if not s.finished)
        self.metrics.queue(user(engine.running), user(engine.waiting),
                           held / (engine.max_num_seqs * engine.max_model_len))

    def _count_tokens(self, sequences: list[Sequence]) -> None:
        """Per step, as vLLM counts them: a request's prompt tokens and time to first token
        once its first token is out, and the tokens each step added. The audit's re-runs are
        not traffic."""
        for sequence in sequences:
            if _is_audit(sequence) or sequence.first_token_time is None:
                continue
            if not sequence.counted_prompt:
                sequence.counted_prompt = True
                self.metrics.first_token(len(sequence.prompt_ids), sequence.first_token_time - sequence.arrival)
            self.metrics.generated(sequence.output_tokens - sequence.counted_generated)
            sequence.counted_generated = sequence.output_tokens

    def _preempt_audits(self) -> None:
        """Audits run in idle time only: while a user request waits or runs, every audit's
        re-run stops and goes back to the audit's backlog, to run again at the next quiet
        spell. (An audit held its row to its end: with one row, a lone client got "queue
        full" from a server whose gauges showed nothing running; found in review. Then one
        gave up its row only when no row was free: a request arriving beside a free row
        waited behind the audit's prefill chunks and decoded beside it, 48 steps instead of
        1 in the review's run.)"""
        engine = self.engine
        if self.auditor is None:
            return
        with engine.lock:
            queued = list(engine.waiting)
        present = list(engine.running) + queued
        if all(_is_audit(s) or s.finished for s in present):
            return
        for sequence in present:
            if _is_audit(sequence) and not sequence.finished:
                sequence.preempted = True
                engine.abort(sequence)

    def _fail_all(self, reason: str | None = None) -> list[Sequence]:
        engine = self.engine
        failed = list(engine.reaped)  # reaped by the failed step before it failed
        engine.reaped = []
        for sequence in list(engine.running):
            if sequence.finished:  # finished in the failed step: reaped with the others, reported once
                continue
            sequence.error = "internal error while decoding" + (f": {reason}" if reason else "")
            try:
                engine._finish(sequence, "abort")
            except Exception:  # its text or listener failed again: end it without them, the thread lives on
                logger.exception("ending request %s failed", sequence.request_id)
                sequence.finish_reason = "abort"
                if sequence.listener is not None:
                    sequence.listener(sequence, StepOutput([], "", "abort"))
        engine._reap(failed)
        return failed

    def _finished(self, sequence: Sequence) -> None:
        if _is_audit(sequence):
            self.auditor.offer(sequence)
            return
        saved = self.speculation.seconds_saved(sequence)
        self.metrics.finished(sequence.finish_reason, sequence.stats.wall_seconds, sequence.task_type, saved,
                              sequence.cached_tokens, sequence.looked_up)
        self.metrics.request_done(len(sequence.prompt_ids), sequence.output_tokens, sequence.params.max_new_tokens,
                                  sequence.arrival, sequence.scheduled_time, sequence.first_token_time,
                                  sequence.finish_time if sequence.finish_time is not None else time.perf_counter())
        self.speculation.observe(sequence, self.metrics)
        if self.auditor is not None and sequence.finish_reason != "abort":
            self.auditor.offer(sequence)
            self._report_audits()  # before the reply goes out: a client that waits for audits sees this one

    def check_prompt(self, prompt_ids: list[int], param: str = "prompt") -> None:
        """A 400 naming the problem for token ids outside the vocabulary or a prompt beyond
        the context; ``param``: where the request put it (a chat's is ``messages``)."""
        try:
            self.engine.check_prompt(prompt_ids)
        except PromptError as error:
            code = "context_length_exceeded" if isinstance(error, ContextLengthError) else None
            raise APIError(400, str(error), param=param, code=code) from None

    def submit(self, prompt_ids: list[int], params: SamplingParams, options: SpeculativeOptions | None,
               task_type: str | None, prompt_text: str, request_id: str, queue: asyncio.Queue,
               index: int = 0, choices: int = 1, cache_salt: str | None = None) -> Sequence:
        """Queue one sequence, choice ``index`` of ``choices`` (the first checks that the
        queue has room for all of them); its outputs arrive on ``queue`` as (index,
        StepOutput). The caller has checked the prompt (``check_prompt``)."""
        if not self.accepting:
            raise APIError(503, "the server is shutting down", "server_error", code="shutting_down",
                           headers={"Retry-After": "5"})
        if self.engine_stopped():  # nothing would ever answer it
            raise APIError(503, "the server's engine has stopped; restart the server", "server_error",
                           code="engine_stopped")
        # a request that a free row takes at the next step is not queued: only those beyond
        # the free rows count against --max-queued-requests
        # rows held by audits' re-runs count as free: the engine takes them back (_preempt_audits)
        with self.engine.lock:  # both read at one moment: the engine thread moves requests from one to the other
            free_rows = len(self.engine.free_rows) + sum(_is_audit(s) for s in list(self.engine.running))
            waiting = self.engine.num_waiting
        if index == 0 and waiting + choices > self.max_queued_requests + free_rows:
            # a request that can never run is told so (400), not given a 503 that clients
            # retry (found in review); plan() checks the others
            self.speculation.check(options, task_type)
            raise APIError(503, f"the request queue is full ({self.max_queued_requests} waiting); retry later",
                           "server_error", code="overloaded", headers={"Retry-After": "1"})
        plan = self.speculation.plan(options, task_type, prompt_text, params)
        loop = asyncio.get_running_loop()

        def listener(sequence: Sequence, output: StepOutput) -> None:
            try:
                count(sequence, output)
            except Exception:  # the client gets its output all the same (found in the suite: a
                # failure here, on a request's last step, left that request waiting forever:
                # finished, it was no longer among the running requests a failed step aborts)
                logger.exception("counting a request's step for /metrics failed")
            loop.call_soon_threadsafe(queue.put_nowait, (index, output))

        def count(sequence: Sequence, output: StepOutput) -> None:
            now = time.perf_counter()
            if output.finish_reason != "abort":
                prior = self.speculation.calibrated_prior(sequence.method) if sequence.proposer is not None else None
                self.metrics.step(output.drafted, output.accepted, sequence.task_type, prior)
            # a step that produced only the EOS produced a token too (vLLM counts its gap; the
            # usage and generation_tokens count it)
            if sequence.last_emit is not None and (output.token_ids or (output.finish_reason and sequence.ended_at_eos)):
                self.metrics.token_gap(now - sequence.last_emit)
            sequence.last_emit = now
            if output.finish_reason is not None:
                # the last step's tokens and the running gauge before the client has its reply
                # (they were updated after the step: a client reading /metrics on its response
                # found its last tokens missing and its request still running; found in review)
                self._count_tokens([sequence])
                self._report_queue()
                self._report(sequence)

        sequence = self.engine.add(prompt_ids, params, request_id, speculate=plan.speculate, proposer=plan.proposer,
                                   policy=plan.policy, listener=listener, prior_alpha=plan.prior,
                                   task_type=plan.task, method=plan.method, cache_salt=cache_salt)
        self._report_queue()
        self.wakeup.set()
        return sequence

    def abort(self, sequence: Sequence) -> None:
        self.engine.abort(sequence)
        self.wakeup.set()


# -- speculation per request -------------------------------------------------------------
@dataclass
class Plan:
    speculate: bool
    method: str
    proposer: Any
    policy: Any
    prior: float | None
    task: str


class SpeculationChoices:
    """Which drafter and k policy a request gets. ``drafters``: method -> (make_proposer,
    make_policy(k) where k is an int or 'auto', drafter key); the server's configured
    method is ``default``. ``router`` (control.router.Router) labels the task and may turn
    speculation off for tasks where it measured a loss; ``profile`` prices seconds saved."""

    def __init__(self, drafters: dict, default: str, router=None, profile=None):
        self.drafters = drafters
        self.default = default
        self.router = router
        self.profile = profile
        self.lock = threading.Lock()

    def _asked(self, options: SpeculativeOptions | None) -> str:
        """The method a request names, as it names it (the server's default where it names none)."""
        return options.method if options is not None and options.method else self.default

    def _method(self, options: SpeculativeOptions | None) -> str:
        """The method a request asks for, as our name."""
        method = self._asked(options)
        return VLLM_METHODS.get(method, method)

    def check(self, options: SpeculativeOptions | None, task_type: str | None) -> None:
        """Refuse (400) what ``plan`` could never serve, without planning anything."""
        from ..control.router import TASKS

        if task_type is not None and task_type not in TASKS:
            raise APIError(400, f"unknown task_type {task_type!r}; choose from {sorted(TASKS)}", param="task_type")
        if options is not None and not options.enabled:
            return
        method = self._method(options)
        if method == "none" and options is not None and isinstance(options.num_speculative_tokens, int):
            # the request's own validator refuses method none with a k; the server's default
            # none ignored it (found in review: a 200 that drafted nothing)
            raise APIError(400, "this server decodes plainly by default (method 'none'): num_speculative_tokens "
                                "needs a method in the request's speculative options", param="speculative.method")
        if method != "none" and method not in self.drafters:
            known = sorted(set(self.drafters) | {"none"})
            # the name the client sent (draft_model, not our "draft"; found in review)
            raise APIError(400, f"speculative method {self._asked(options)!r} is not available on this server; "
                                f"choose from {known}",
                           param="speculative.method", code="unknown_speculative_method")

    def plan(self, options: SpeculativeOptions | None, task_type: str | None, prompt_text: str,
             params: SamplingParams | None = None) -> Plan:
        """``params``: the request's sampling; a seeded sampled request whose drafter samples
        and whose k is fixed keeps speculating where the router turned its task off."""
        from ..control.policies import FixedK
        from ..control.router import classify

        self.check(options, task_type)
        def plain() -> Plan:
            return Plan(False, "none", None, None, None, task_type or (classify(prompt_text) if prompt_text else "unknown"))

        if options is not None and not options.enabled:
            return plain()
        method = self._method(options)
        if method == "none":
            return plain()
        make_proposer, make_policy, drafter = self.drafters[method]
        task, prior, proposer = task_type or "unknown", None, None
        if self.router is not None and prompt_text:
            with self.lock:  # the task: the request's label, else the router's classification; it may turn speculation off
                route = self.router.route(prompt_text, method, drafter, task=task_type)
            task = route.task
            # the route's prior: on a retry of a task turned off, the optimistic one that lets
            # the request draft and measure again (found in review: the measured, low
            # acceptance was put back here, and a retried request decoded plainly)
            prior = route.prior_alpha if route.prior_alpha is not None else self.router.prior(task, drafter)
            # the router's "off" for the task yields to a request that asked for a method or a
            # k (found in review: a k alone was dropped and the request decoded plainly)
            # ("auto" restates the server's default and asks for nothing)
            asked = options is not None and (options.method is not None
                                             or isinstance(options.num_speculative_tokens, int))
            if route.method == "none" and not asked:
                # a seeded sampled request whose drafter samples its drafts (EAGLE chains)
                # draws other numbers decoding plainly than speculating with a fixed k, so the
                # router's off (and its retry every so many requests) changed its text from
                # one repeat to the next; docs promise it the same text (found in review)
                seeded = params is not None and not params.greedy and params.seed is not None
                if not seeded:
                    return Plan(False, "none", None, None, None, task)
                proposer = make_proposer()
                k = None if options is None else options.num_speculative_tokens
                if not (getattr(proposer, "samples_drafts", False) and isinstance(make_policy(k), FixedK)):
                    return Plan(False, "none", None, None, None, task)
        elif prompt_text and task_type is None:
            task = classify(prompt_text)
        k = None if options is None else options.num_speculative_tokens  # None: the method's default
        proposer = make_proposer() if proposer is None else proposer
        most = getattr(proposer, "max_drafts", None)  # Medusa: one draft per head
        if isinstance(k, int) and most is not None and k > most:
            raise APIError(400, f"speculative method {method!r} drafts at most {most} tokens a step (one per head); "
                                f"got num_speculative_tokens {k}", param="speculative.num_speculative_tokens",
                           code="invalid_speculative_tokens")
        return Plan(True, method, proposer, make_policy(k), prior, task)

    def seconds_saved(self, sequence: Sequence) -> float | None:
        """Plain decoding's estimated decode time for the same tokens (cost profile, one
        step per token) minus the decode time this request took; None without a
        profile or without speculation, and for a request decoded in a batch: its share of
        a batched pass is cheaper than a step alone whether or not it drafted, and that
        saving is the batch's, not speculation's (found in review: +0.35 s "saved" by a
        drafter that was never right, at 4 rows). The router leaves those out too."""
        if (self.profile is None or sequence.proposer is None or not sequence.stats.new_tokens
                or sequence.batched_steps):
            return None
        from ..control.router import plain_decode_seconds

        stats = sequence.stats
        # plain steps priced as the router prices them (found in review: the two disagreed)
        plain = plain_decode_seconds(stats, self.profile, len(sequence.prompt_ids),
                                     getattr(getattr(sequence, "policy", None), "costs", None))
        return plain - (stats.draft_seconds + stats.verify_seconds)  # not its wait for a row

    def observe(self, sequence: Sequence, metrics: ServerMetrics) -> None:
        if sequence.proposer is None:
            return
        drafter = self.drafters[sequence.method][2]
        metrics.drift_ratio(sequence.task_type)  # over the window's steps, each against its drafter's prior
        # The router learns from requests that decoded alone, timed by their own steps
        # (drafting and the target's passes; not the other requests' prefill chunks that
        # ran in between). A request decoded in a batch took the batch's time: priced
        # against one plain step per token it measured 0.2-0.3x at 8-16 clients, which
        # turned speculation off for its task at one client too (bench-serve, c1 after c8
        # and c16: spec/plain 1.38x, then 1.08x and 0.98x). Under load the batch cap
        # decides per step whether drafting pays.
        if (self.router is not None and sequence.stats.draft_tokens and self.profile is not None
                and not sequence.batched_steps):
            from ..control.router import speedup_from_stats

            stats = sequence.stats
            speedup = speedup_from_stats(stats, self.profile, len(sequence.prompt_ids),
                                         decode_seconds=stats.draft_seconds + stats.verify_seconds,
                                         costs=getattr(sequence.policy, "costs", None))
            with self.lock:
                self.router.observe(sequence.task_type, drafter, stats.first_alpha, speedup, stats.new_tokens)

    def calibrated_prior(self, method: str) -> float | None:
        if self.profile is None:
            return None
        rates = self.profile.acceptance.get(self.drafters[method][2])
        return rates[0] if rates else None


# -- responses ---------------------------------------------------------------------------
ENGINE_STOPPED = "the server's engine stopped before this request finished; restart the server"


_UNION_TAG = re.compile(r"[a-z][a-z0-9-]*\[.*\]")  # list[int], function-after[...], tagged-union[...]


def _field_path(location) -> list[str]:
    """A pydantic error location as the client's field path: the body's fields and list
    indices, without the union member tags pydantic adds (``str``, ``list[int]``,
    ``function-after[...]``). A key of the client's with a "-" in it stays (found in review:
    ``stream_options.include-usage`` was named as ``stream_options``)."""
    return [str(part) for part in location if part != "body" and not (
        isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict", "list", "none")
                                   or _UNION_TAG.fullmatch(part)))]


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """OpenAI's 400 message and param for a request that fails validation: the field that
    failed, and where it takes one of several forms (a union), what those forms are."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON ({first.get('ctx', {}).get('error', first.get('msg'))})", None
    path = _field_path(first.get("loc", ()))
    field = ".".join(path) or "body"
    # the union members pydantic tried for this field, in the order it tried them
    members = list(dict.fromkeys(
        str(part) for e in errors if _field_path(e.get("loc", ()))[:len(path)] == path
        for part in e.get("loc", ()) if part != "body" and str(part) not in path
        and str(part) not in _field_path(e.get("loc", ()))))
    if len(members) > 1:  # not the first member's complaint alone
        return f"{field}: must be one of {', '.join(members)}", field
    return f"{field}: {first.get('msg', 'invalid value')}", field if path else None


def stop_reason(sequence: Sequence) -> str | None:
    """vLLM's ``stop_reason``: the stop string that ended a choice; None where it ended at
    EOS or its token budget (or before it finished)."""
    tracker = getattr(sequence, "tracker", None)
    return tracker.stop_reason if sequence.finish_reason == "stop" and tracker is not None else None


def usage(sequences: list[Sequence]) -> dict:
    """OpenAI's usage for one request: the prompt once, every choice's completion (an EOS
    that ended it included, as vLLM counts); cached tokens as the first choice's (the others
    usually reuse its prompt)."""
    prompt, completion = len(sequences[0].prompt_ids), sum(s.output_tokens for s in sequences)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sequences[0].cached_tokens}}


def speculation_summary(sequences: list[Sequence]) -> dict:
    """The request's speculation figures, summed over its choices."""
    total = GenerationStats(draft_tokens=sum(s.stats.draft_tokens for s in sequences),
                            accepted_tokens=sum(s.stats.accepted_tokens for s in sequences),
                            target_forwards=sum(s.stats.target_forwards for s in sequences),
                            ended_early=sum(s.stats.ended_early for s in sequences))
    first = sequences[0]
    # vLLM's mean acceptance length, as the task gauge and bench-serve read it: 1 + accepted
    # per step that drafted (found in review: this field was tokens per target pass, plain
    # passes included, so it read 2.0 where vLLM and our gauge read 5.0); that figure is
    # tokens_per_target_pass. Of the output only: drafts past its end, drafted, accepted or
    # rejected, are not counted here (GenerationStats.drop_accepted); /metrics counts the whole step
    drafting_steps = sum(s.stats.drafting_steps for s in sequences)
    return {"method": getattr(first, "method", "none"), "drafted_tokens": total.draft_tokens,
            "accepted_tokens": total.accepted_tokens, "acceptance_rate": round(total.alpha, 4),
            "mean_accepted_length": round(1 + total.accepted_tokens / drafting_steps, 4) if drafting_steps else 1.0,
            "tokens_per_target_pass": round(total.tau, 4), "target_passes": total.target_forwards,
            "task_type": first.task_type}


def nth_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request seeded ``seed`` (None stays unseeded),
    wrapped into the signed 64-bit range the request's seed lies in."""
    return None if seed is None else (seed + index + 2 ** 63) % 2 ** 64 - 2 ** 63


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class ClosingStream(StreamingResponse):
    """A stream that frees its sequences' rows when the response ends, however it ends.
    The body generator's own ``finally`` runs only when the generator is closed: a client
    that stopped reading (its send waiting on a full socket) and then went away left the
    generator suspended at a yield, closed by the next cyclic garbage collection; until
    then its sequence decoded on and held its row (found in review)."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def create_app(state: ServerState, tokenizer) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.start()
        yield
        state.accepting = False  # drain: uvicorn waits for in-flight requests first
        state.stop()
        encoder.shutdown(wait=False, cancel_futures=True)  # its thread outlived the app (found in review)

    app = FastAPI(title="specdecode", lifespan=lifespan)
    app.state.server = state
    # prompts are tokenized (and chat templates rendered) on a thread of their own, one at a
    # time, as vLLM does: on the event loop a 10 MB prompt held every stream and /health for
    # 21 s (found in review). Encoding never changes the tokenizer's settings, so it may run
    # beside the engine thread's decoding.
    encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdecode-encode")

    class KeyFirst:
        """With --api-key, every route under /v1 (and the cache reset) answers 401 before
        its body is read, as vLLM's middleware does (found in review: an undecodable body got
        400 and an unknown /v1 route 404 without the key). Plain ASGI: streams and client
        disconnects pass through untouched."""

        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            path = scope.get("path", "")
            if (scope["type"] == "http" and state.api_key is not None
                    and (path.startswith("/v1/") or path in ("/v1", "/reset_prefix_cache"))):
                try:
                    authorize(Request(scope))
                except APIError as refused:
                    await refused.response()(scope, receive, send)
                    return
            await self.app(scope, receive, send)

    app.add_middleware(KeyFirst)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, error: RequestValidationError):
        # a client without the key learns nothing of the schema: KeyFirst answered it already
        content_type = request.headers.get("content-type", "")
        if content_type and content_type.split(";")[0].strip().lower() != "application/json":
            # curl -d sends a form's type: FastAPI never read the JSON (found in review: "body:
            # Input should be a valid dictionary", which names nothing the client can fix)
            return error_response(415, f"the body must be JSON sent with 'Content-Type: application/json', "
                                       f"not {content_type!r}")
        if not content_type and any(tuple(e.get("loc", ())) == ("body",) and e.get("type") != "missing"
                                    for e in error.errors()):
            # a body sent with no type at all (requests.post(data=...)) is not read either (found in review)
            return error_response(415, "the body must be JSON sent with 'Content-Type: application/json'; "
                                       "the request had no Content-Type")
        message, param = validation_message(error.errors())  # the field is OpenAI's param, not its type
        return error_response(400, message, param=param)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError):
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        # its headers too: a 405's Allow names the methods the route takes (found in review: dropped)
        return error_response(error.status_code, str(error.detail), kind, headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception):
        logger.exception("unexpected error serving %s", request.url.path)
        return error_response(500, "internal server error", "server_error")

    def authorize(request: Request) -> None:  # KeyFirst's check, for every /v1 route and the cache reset
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')", "authentication_error",
                           code="invalid_api_key")

    def check_model(name: str | None) -> None:
        if name is not None and name != state.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {state.model_name!r}",
                           param="model", code="model_not_found")

    def encode_completion(body: CompletionRequest) -> tuple[list[int], str]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):  # OpenAI's batch forms
            if len(prompt) != 1:
                raise APIError(400, "a batch of prompts is not supported; send one prompt per request", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, list):
            return list(prompt), ""
        if not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer; send the prompt as token ids", param="prompt")
        add_special = body.add_special_tokens is not False
        if (problem := not_utf8(prompt)) is not None:  # found in review: the tokenizer's TypeError text reached the client
            raise APIError(400, f"the prompt is not valid UTF-8 text ({problem})", param="prompt")
        try:
            return list(tokenizer(prompt, add_special_tokens=add_special)["input_ids"]), prompt
        except (TypeError, ValueError, UnicodeError) as error:  # what else a tokenizer refuses (not_utf8 came first)
            raise APIError(400, f"the prompt could not be tokenized: {error}", param="prompt") from None

    def encode_chat(body: ChatRequest) -> tuple[list[int], str]:
        if body.add_special_tokens:
            raise APIError(400, "add_special_tokens is not supported for chat by this server (only false: the chat "
                                "template writes the special tokens)", param="add_special_tokens")
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        messages = [m.for_template() for m in body.messages]
        for index, message in enumerate(messages):
            if (problem := not_utf8(message["content"])) is not None:
                raise APIError(400, f"messages[{index}].content is not valid UTF-8 text ({problem})", param="messages")
        try:
            encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)
        except Exception as error:  # template errors (e.g. roles out of order) name the problem
            raise APIError(400, f"the chat template rejected the messages: {error}", param="messages") from None
        return list(encoded["input_ids"]), "\n".join(m["content"] for m in messages if m["role"] == "user")

    async def run(request: Request, body, prompt_ids, prompt_text, max_tokens, chat: bool,
                  max_tokens_param: str = "max_tokens"):
        params = body.sampling(max_tokens, state.sampling_defaults)
        if getattr(body, "suffix", None):
            raise APIError(400, "suffix (insertion) is not supported", param="suffix")
        if params.stop and tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer; this model has none", param="stop")
        state.check_prompt(prompt_ids, "messages" if chat else "prompt")  # before anything decodes the ids (echo)
        limit = state.engine.max_model_len
        if len(prompt_ids) + max_tokens > limit:  # as OpenAI and vLLM answer: never a silently shorter reply
            raise APIError(400, f"this model's maximum context length is {limit} tokens, but {len(prompt_ids) + max_tokens} "
                                f"were requested ({len(prompt_ids)} in the prompt, {max_tokens} to generate); "
                                f"reduce the prompt or {max_tokens_param}", param=max_tokens_param,
                           code="context_length_exceeded")
        echo = ""
        if chat and getattr(body, "echo", False):  # OpenAI refuses it; vLLM's differs (the last assistant message)
            raise APIError(400, "echo is only supported for completions", param="echo")
        if getattr(body, "echo", False):
            echo = prompt_text or (decode(tokenizer, prompt_ids, skip_special_tokens=False) if tokenizer is not None
                                   else "")
        request_id = ("chatcmpl-" if chat else "cmpl-") + client_request_id(request, body)
        room = state.engine.max_num_seqs + state.max_queued_requests
        if body.n > room:  # the choices are admitted together
            raise APIError(400, f"n = {body.n} exceeds what the server holds at once (--max-num-seqs "
                                f"{state.engine.max_num_seqs} + --max-queued-requests {state.max_queued_requests})",
                           param="n")
        queue: asyncio.Queue = asyncio.Queue()
        sequences = []
        try:
            for index in range(body.n):  # choice i samples with seed + i: distinct, and reproducible
                choice_params = params if index == 0 else replace(params, seed=nth_seed(params.seed, index))
                sequences.append(state.submit(prompt_ids, choice_params, body.speculative, body.task_type,
                                              prompt_text, request_id if body.n == 1 else f"{request_id}-{index}",
                                              queue, index, body.n, body.cache_salt))
        except Exception:  # none of the choices runs without the others
            for sequence in sequences:
                state.abort(sequence)
            raise
        token_ids = body.return_token_ids or tokenizer is None
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return ClosingStream(stream(sequences, queue, request_id, chat, include_usage, echo, token_ids),
                                 lambda: [state.abort(s) for s in sequences if not s.finished],
                                 media_type="text/event-stream")
        return await collect(request, sequences, queue, request_id, chat, echo, token_ids)

    async def collect(request: Request, sequences: list[Sequence], queue: asyncio.Queue, request_id: str,
                      chat: bool, echo: str = "", token_ids: bool = False):
        texts = [[echo] for _ in sequences]
        done: set[int] = set()
        checked = time.perf_counter()

        def abort_all() -> None:
            for sequence in sequences:
                state.abort(sequence)

        try:
            while len(done) < len(sequences):
                try:
                    index, output = await asyncio.wait_for(queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    index, output = None, None
                if time.perf_counter() - checked >= 0.5:  # n choices may leave no quiet half second
                    checked = time.perf_counter()
                    if await request.is_disconnected():
                        abort_all()
                        return Response(status_code=499)
                    if state.engine_stopped():  # found in review: the request waited forever
                        abort_all()
                        raise APIError(500, ENGINE_STOPPED, "server_error", code="engine_stopped")
                if output is None:
                    continue
                texts[index].append(output.text)
                if output.finish_reason is not None:
                    done.add(index)
                    if getattr(sequences[index], "error", None):
                        abort_all()
                        break
        except asyncio.CancelledError:
            abort_all()
            raise
        failed = next((s.error for s in sequences if getattr(s, "error", None)), None)
        if failed:
            raise APIError(500, failed, "server_error")
        body = {"id": request_id, "created": int(time.time()), "model": state.model_name, "usage": usage(sequences),
                "system_fingerprint": FINGERPRINT, "speculative": speculation_summary(sequences)}
        if chat:
            body.update(object="chat.completion", choices=[
                {"index": i, "message": {"role": "assistant", "content": "".join(text)}, "logprobs": None,
                 "finish_reason": s.finish_reason, "stop_reason": stop_reason(s)}
                for i, (s, text) in enumerate(zip(sequences, texts))])
        else:
            body.update(object="text_completion", choices=[
                {"index": i, "text": "".join(text), "logprobs": None, "finish_reason": s.finish_reason,
                 "stop_reason": stop_reason(s)} for i, (s, text) in enumerate(zip(sequences, texts))])
        if token_ids:  # where vLLM puts them: the prompt's per choice (completions) or per response (chat)
            for choice, sequence in zip(body["choices"], sequences):
                choice["token_ids"] = list(sequence.generated)
                if not chat:
                    choice["prompt_token_ids"] = list(sequence.prompt_ids)
            if chat:
                body["prompt_token_ids"] = list(sequences[0].prompt_ids)
        return JSONResponse(body)

    async def stream(sequences: list[Sequence], queue: asyncio.Queue, request_id: str, chat: bool,
                     include_usage: bool, echo: str = "", token_ids: bool = False):
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        announced: set[int] = set()  # chat choices whose first chunk (with the role) went out

        with_prompt_ids: set[int] = set()  # choices whose prompt token ids went out (token_ids)

        def chunk(index: int, text: str | None, finish: str | None, ids: list[int] | None = None) -> dict:
            reason = stop_reason(sequences[index]) if finish is not None else None
            if chat:
                delta = {} if text is None else {"content": text}
                if index not in announced:  # the role rides with the choice's first output, as in vLLM:
                    announced.add(index)    # a client timing its first token reads that chunk
                    delta = {"role": "assistant", "content": text or ""}
                choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish,
                          "stop_reason": reason}
            else:
                choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish,
                          "stop_reason": reason}
            body = {"id": request_id, "object": kind, "created": created, "model": state.model_name, "choices": [choice]}
            if token_ids:
                choice["token_ids"] = list(ids or [])
                if index not in with_prompt_ids:
                    with_prompt_ids.add(index)
                    (body if chat else choice)["prompt_token_ids"] = list(sequences[index].prompt_ids)
            if include_usage:  # OpenAI: every chunk but the last carries "usage": null
                body["usage"] = None
            return body

        try:
            if echo:  # completions only
                for index in range(len(sequences)):
                    yield _sse(chunk(index, echo, None))
            done = 0
            while done < len(sequences):
                try:
                    index, output = await asyncio.wait_for(queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if not state.engine_stopped():
                        continue
                    yield _sse({"error": {"message": ENGINE_STOPPED, "type": "server_error", "param": None,
                                          "code": "engine_stopped"}})
                    break
                sequence = sequences[index]
                if output.finish_reason is None:
                    if output.text or (token_ids and output.token_ids):
                        yield _sse(chunk(index, output.text, None, output.token_ids))
                    continue
                if getattr(sequence, "error", None):
                    yield _sse({"error": {"message": sequence.error, "type": "server_error", "param": None,
                                          "code": None}})
                    break
                final = chunk(index, output.text or None, output.finish_reason, output.token_ids)  # the last text with the reason
                final["speculative"] = speculation_summary([sequence])
                yield _sse(final)
                done += 1
            else:
                if include_usage:
                    yield _sse({"id": request_id, "object": kind, "created": created, "model": state.model_name,
                                "choices": [], "usage": usage(sequences)})
            yield _sse("[DONE]")
        finally:
            for sequence in sequences:
                if not sequence.finished:  # the client went away: free its row
                    state.abort(sequence)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        check_model(body.model)
        if (body.model_extra or {}).get("max_completion_tokens") is not None:  # ignored, the reply ran to 16 tokens
            raise APIError(400, "max_completion_tokens is a chat parameter; completions take max_tokens",
                           param="max_completion_tokens")
        prompt_ids, text = await asyncio.get_running_loop().run_in_executor(encoder, encode_completion, body)
        return await run(request, body, prompt_ids, text, body.max_tokens or 16, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatRequest):
        check_model(body.model)
        prompt_ids, text = await asyncio.get_running_loop().run_in_executor(encoder, encode_chat, body)
        room = state.engine.max_model_len - len(prompt_ids)
        max_tokens = body.max_completion_tokens or body.max_tokens or max(room, 1)
        named = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        return await run(request, body, prompt_ids, text, max_tokens, chat=True, max_tokens_param=named)

    @app.get("/v1/models")
    async def models(request: Request):
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "specdecode", "max_model_len": state.engine.max_model_len}]}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request):
        """vLLM's route: forget every cached prefix before the next admission (benchmarks
        that replay prompts use it so that a level does not reuse the last one's)."""
        state.engine.reset_prefix_cache()
        state.wakeup.set()
        return Response(status_code=200)

    @app.get("/health")
    async def health():
        if state.engine_stopped():
            return error_response(503, "the engine thread has stopped", "server_error")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        registry = state.metrics.registry
        if state.metrics.constant_labels:
            registry = LabelledRegistry(registry, state.metrics.constant_labels)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
