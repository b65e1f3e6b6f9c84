"""Building the server from flags: the target, the drafters a request may ask for, the
engine thread's state, and uvicorn."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from ..config import (MAX_NGRAM, MAX_SERVED_K, VLLM_METHODS, ConfigError, EngineConfig, SamplingParams,
                      SpecDecodeError, SpeculativeConfig, is_count, parse_int_list)
from .app import FINGERPRINT, ServerState, SpeculationChoices, create_app
from .batch import BatchEngine, clone_policy
from .metrics import ServerMetrics

SCHEDULES = ("fcfs", "task")
UNSERVED = ("draft", "tree")  # our methods the batched engine does not run yet
SPEC_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "preset",
             "router", "k_max", "k_policy"}
# a preset's keys (the flags of `specdecode generate`) -> ours; ngram_sizes has no JSON key of its own
PRESET_KEYS = {"method": "method", "k": "num_speculative_tokens", "k_max": "k_max", "k_policy": "k_policy",
               "route": "router"}
# what a preset may set that a server does not: sampling is each request's to choose
PRESET_PER_REQUEST = {"temperature", "top_p", "top_k", "max_new_tokens"}


def _spec_int(data: dict, key: str, default: int) -> int:
    # JSON integers only: int() would take "3", truncate 2.5 and read true as 1
    value = data.get(key, default)
    if not is_count(value) or value < 1:
        raise ConfigError(f"--speculative-config {key} must be an integer >= 1, got {value!r}")
    return value


def method_of_model(model: str) -> str | None:
    """The method a drafter's ``model`` implies where no method is given, as vLLM infers
    it: "ngram" (or its older "[ngram]") is prompt lookup; a directory holding a token store
    is suffix lookup's; a head's config.json (ours, vLLM/EAGLE's eagle3, speculators') or a
    name with "eagle" in it is an EAGLE head; Medusa heads say so in their config. None:
    none of these (vLLM reads the rest as a draft model)."""
    if model in ("ngram", "[ngram]"):
        return "ngram"
    path = Path(model).expanduser()
    if (path / "tokens.safetensors").is_file():
        return "suffix"
    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raw = None
    if isinstance(raw, dict):
        if raw.get("architecture") == "specdecode-medusa" or raw.get("model_type") == "medusa":
            return "medusa"
        from ..proposers.eagle_formats import detect

        try:  # the head loader's own reading of the three layouts
            detect(raw)
            return "eagle"
        except SpecDecodeError:
            pass
    return "eagle" if "eagle" in path.name.lower() else None


def parse_speculative_config(text: str | dict | None) -> tuple[SpeculativeConfig, bool]:
    """vLLM's ``--speculative-config`` JSON (method, model, num_speculative_tokens,
    prompt_lookup_min/max) plus ours ("auto" k, preset, router, k_max, k_policy) -> (config, router on).
    A preset supplies defaults that the JSON's own keys override."""
    if text is None or text == "":
        return SpeculativeConfig(method="suffix"), True
    try:
        data = json.loads(text) if isinstance(text, str) else dict(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"--speculative-config is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError("--speculative-config must be a JSON object")
    unknown = sorted(set(data) - SPEC_KEYS)
    if unknown:
        raise ConfigError(f"--speculative-config has unknown keys {unknown}; known: {sorted(SPEC_KEYS)}")
    ngram, given = (3, 2, 1), set(data)  # the keys the JSON itself sets (a preset's may not apply)
    if "preset" in data:
        from ..config import preset

        name = data.pop("preset")
        if not isinstance(name, str):
            raise ConfigError(f"--speculative-config preset must be a preset's name, got {name!r}")
        values = preset(name)
        unusable = sorted(set(values) - set(PRESET_KEYS) - PRESET_PER_REQUEST - {"ngram_sizes"})
        if unusable:
            raise ConfigError(f"preset {name!r} sets {unusable}, which --speculative-config does not take")
        if "ngram_sizes" in values:
            ngram = parse_int_list(values["ngram_sizes"], f"preset {name!r} ngram_sizes")
        data = {**{PRESET_KEYS[key]: value for key, value in values.items() if key in PRESET_KEYS}, **data}
    if isinstance(data.get("model"), str) and not data["model"].strip():  # Path("") is the working directory
        raise ConfigError("--speculative-config model is empty: give the drafter's directory, or leave model out")
    if "method" not in data and isinstance(data.get("model"), str):
        # the method from the model, as vLLM infers it (found in review: the model was read
        # as a token store whatever it was, and vLLM's {"model": "[ngram]"} failed after the
        # target loaded)
        inferred = method_of_model(data["model"])
        if inferred is None:
            raise ConfigError(f"--speculative-config gives model {data['model']!r} without a method, and it is no "
                              "token store, EAGLE head or Medusa heads (vLLM would read it as a draft model, which "
                              "serve does not run); name the method: 'eagle' or 'eagle3', 'medusa' or 'suffix'")
        data = {**data, "method": inferred}
        if inferred == "ngram":
            del data["model"]
    method = data.get("method", "suffix")
    if not isinstance(method, str) or method not in VLLM_METHODS:
        # the methods serve runs (found in review: the list named vLLM's "[ngram]" model alias,
        # and draft_model and tree, which serve refuses)
        served = sorted(name for name, ours in VLLM_METHODS.items() if name.isidentifier() and ours not in UNSERVED)
        raise ConfigError(f"unknown speculative method {method!r}; serve runs {served}")
    method = VLLM_METHODS[method]
    if "prompt_lookup_min" in data or "prompt_lookup_max" in data:
        # vLLM's reading: one bound given alone is the other bound too
        low = _spec_int(data, "prompt_lookup_min", None) if "prompt_lookup_min" in data else None
        high = _spec_int(data, "prompt_lookup_max", None) if "prompt_lookup_max" in data else None
        low, high = (low if low is not None else high), (high if high is not None else low)
        if not low <= high <= MAX_NGRAM:  # a range of 10**10 sizes ran out of memory (found in review)
            raise ConfigError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max <= {MAX_NGRAM}, got {low} and {high}")
        ngram = tuple(range(high, low - 1, -1))
    k = data.get("num_speculative_tokens", "auto")
    if k != "auto":
        k = _spec_int(data, "num_speculative_tokens", 0)
        if not 1 <= k <= MAX_SERVED_K:  # as a request's own; 100,000 made as many /metrics series (found in review)
            raise ConfigError(f"--speculative-config num_speculative_tokens must be 'auto' or 1..{MAX_SERVED_K}, got {k}")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise ConfigError(f"--speculative-config model must be a path or name, got {model!r}")
    if model is not None and method in ("none", "ngram"):  # it was taken and ignored
        raise ConfigError(f"--speculative-config model is the drafter's weights (eagle, medusa) or token store (suffix); "
                          f"method {data.get('method', 'suffix')!r} reads none")
    if method == "none" and given & {"num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "k_max",
                                     "k_policy"}:
        # taken and ignored, as model above (k_max and k_policy too: found in review)
        raise ConfigError("--speculative-config method 'none' decodes plainly: num_speculative_tokens, "
                          "prompt_lookup_min/max, k_max and k_policy would be ignored")
    if method not in ("none", "ngram", "suffix") and given & {"prompt_lookup_min", "prompt_lookup_max"}:
        # the head drafters look up no n-grams (the CLI refuses --ngram-sizes for them; found in review)
        raise ConfigError(f"--speculative-config prompt_lookup_min/max are read by methods ngram and suffix only; "
                          f"method {data.get('method')!r} would ignore them")
    router = data.get("router", True)
    if not isinstance(router, bool):  # bool("false") is True: take JSON true/false only
        raise ConfigError(f"--speculative-config router must be true or false, got {router!r}")
    if method in UNSERVED:  # before the config, whose own complaint names CLI flags serve lacks
        raise ConfigError(f"method {data.get('method')!r} is not served by the batched engine yet (a draft model keeps "
                          "one sequence's cache; trees need per-row masks); serve 'suffix', 'ngram', 'eagle' (chains) "
                          "or 'medusa'")
    k_max = _spec_int(data, "k_max", 10)
    if not 1 <= k_max <= MAX_SERVED_K:  # as num_speculative_tokens: /metrics has a series per position (found in review)
        raise ConfigError(f"--speculative-config k_max must be in 1..{MAX_SERVED_K}, got {k_max}")
    spec = SpeculativeConfig(method=method, k=k, draft=model, ngram_sizes=ngram,
                             k_policy=data.get("k_policy", "cost"), k_max=k_max,
                             tree_width=1 if method in ("eagle", "tree") else None)
    return spec, router


def drafter_entry(spec: SpeculativeConfig, target, engine_config: EngineConfig):
    """(make_proposer, make_policy(k), drafter key) for one method."""
    from ..control.policies import FixedK
    from ..factory import build_policy, build_proposer, drafter_key

    template = build_proposer(spec, target, engine_config)
    if spec.method == "eagle":
        from ..proposers.eagle import EagleProposer

        def make_proposer():  # each row its own cache and kernel layer; the head's packed weights are shared
            return EagleProposer(template.head, template.embed_rows)
    elif spec.method == "medusa":
        from ..proposers.medusa import MedusaProposer

        def make_proposer():  # the heads (and their packed rows) are shared; each row keeps its last state
            return MedusaProposer(template.heads, template.capture[0])
    elif spec.method == "suffix":
        from ..proposers.suffix import SuffixProposer

        def make_proposer():  # the store is read-only: every row shares it
            return SuffixProposer(template.store, spec.ngram_sizes)
    else:
        def make_proposer():
            return type(template)(spec.ngram_sizes)
    default = spec.k
    most = getattr(template, "max_drafts", None)  # Medusa: one draft per head
    if isinstance(default, int) and most is not None and default > most:  # before the minutes calibration may take
        raise ConfigError(f"--speculative-config num_speculative_tokens {default}: method {spec.method!r} drafts at "
                          f"most {most} tokens a step (one per head)")
    # built now, before the batched engine owns the runtime's cache: calibrating the
    # drafter's acceptance decodes on the target (once per machine, then cached)
    auto = build_policy(replace(spec, k="auto"), target, template, engine_config.dtype)

    def make_policy(k):
        k = default if k is None else k
        return clone_policy(auto) if k == "auto" else FixedK(int(k))

    return make_proposer, make_policy, drafter_key(spec)


def check_api_key(api_key: str | None) -> None:
    """An empty key (``--api-key "$KEY"`` with KEY unset) is refused: it turned the check
    on and let 'Authorization: Bearer ' through (found in review)."""
    if api_key is not None and not api_key.strip():
        raise ConfigError("--api-key is empty: give the key clients must send, or leave the flag out to serve "
                          "without one")
    # a key no client can send: HTTP trims a header's spaces and carries latin-1, clients send
    # ASCII (found in review: the server started and refused every request)
    if api_key is not None and not (api_key.isascii() and api_key.isprintable() and api_key == api_key.strip()):
        raise ConfigError("--api-key must be printable ASCII without leading or trailing spaces: a client cannot "
                          "send another key in an Authorization header")


def check_serve_options(max_num_seqs: int, max_queued_requests: int, audit_rate: float = 0.0,
                        schedule: str = "fcfs", api_key: str | None = None) -> None:
    """The server's own flags, checked before anything loads (found in review: minutes
    later), and before Ray starts replicas (where each replica's log told it, after Ray's
    tracebacks)."""
    if max_num_seqs < 1:
        raise ConfigError(f"--max-num-seqs must be >= 1, got {max_num_seqs}")
    if max_queued_requests < 0:
        raise ConfigError(f"--max-queued-requests must be >= 0, got {max_queued_requests}")
    if schedule not in SCHEDULES:
        raise ConfigError(f"--schedule must be one of {SCHEDULES}, got {schedule!r}")
    if not 0.0 <= audit_rate <= 1.0:
        raise ConfigError(f"--audit-rate must be in [0, 1], got {audit_rate}")
    check_api_key(api_key)


def check_drafter_files(spec: SpeculativeConfig, model) -> None:
    """A head method needs trained weights for the model: shipped only for the default
    model, else ``model`` in --speculative-config. Said before the target loads (found in
    review: after the cost profile and the calibration, naming --head, a flag serve lacks)."""
    if spec.method not in ("eagle", "medusa", "suffix"):
        return
    if spec.draft is not None:
        if not Path(spec.draft).exists():
            raise ConfigError(f"--speculative-config model {spec.draft!r} does not exist")
        return
    if spec.method == "suffix":  # without a store, the request's own text (said at load)
        return
    from ..models.loading import ModelSource, resolve_model

    source = model if isinstance(model, ModelSource) else resolve_model(str(model))
    if not source.is_default:
        kind = "an EAGLE head trained with `specdecode train eagle`" if spec.method == "eagle" else \
            "Medusa heads trained with `specdecode train medusa`"
        raise ConfigError(f"method {spec.method!r} needs {kind} for {source.name}: give its directory as \"model\" "
                          "in --speculative-config (heads are shipped only for the default model)")


def build_state(engine_config: EngineConfig, speculative: str | None, max_num_seqs: int = 8,
                max_queued_requests: int = 64, api_key: str | None = None, max_model_len: int | None = None,
                served_model_name: str | None = None, audit_rate: float = 0.0, target=None,
                schedule: str = "fcfs", prefix_caching: bool = True,
                prefill_threads: int | None = None, decode_threads: tuple[int, ...] | None = None) -> ServerState:
    from ..control.router import Router
    from ..factory import cost_profile, load_target, log

    spec, use_router = parse_speculative_config(speculative)
    check_serve_options(max_num_seqs, max_queued_requests, audit_rate, schedule, api_key)
    check_drafter_files(spec, engine_config.model if target is None else target.source)
    if target is None:
        log(f"loading {engine_config.model} ({engine_config.dtype})")
        target = load_target(engine_config)
    runtime = target.runtime
    if not hasattr(runtime, "forward_rows"):
        raise ConfigError("the server needs the native runtime (a Llama-family model)")
    drafters = {}
    for method in dict.fromkeys(["ngram", spec.method]):
        if method == "none":
            continue
        # the n-gram sizes the config gave (prompt_lookup_min/max) hold for a request that asks
        # for ngram too (found in review: it drafted with the default sizes)
        method_spec = spec if method == spec.method else SpeculativeConfig(method=method, ngram_sizes=spec.ngram_sizes)
        drafters[method] = drafter_entry(method_spec, target, engine_config)
    # the cost profile prices seconds saved and the batch draft cap (measured once, cached)
    profile = cost_profile(target, engine_config.dtype) if drafters else None
    if profile is not None:  # what batched steps cost here (measured once, cached)
        from ..cost.profile import with_batches
        from ..factory import model_key

        profile = with_batches(profile, model_key(target), runtime)
    engine = BatchEngine(runtime, target.tokenizer, target.eos_token_ids, max_num_seqs=max_num_seqs,
                         max_model_len=max_model_len)
    engine.schedule = schedule
    engine.prefix_caching = prefix_caching
    engine.prefill_threads = prefill_threads
    if profile is not None:
        engine.batch_cost = profile.batch_time_ms
    if decode_threads is not None and len(decode_threads) > 1:
        from ..control.threads import ThreadChoice

        engine.decode_threads = ThreadChoice(decode_threads, profile.batch_time_ms if profile is not None else None,
                                             log=log)
    name = served_model_name or ("SmolLM2-135M-Instruct" if engine_config.model == "default" else engine_config.model)
    metrics = ServerMetrics(name, positions=spec.k if isinstance(spec.k, int) else spec.k_max,
                            max_model_len=engine.max_model_len)
    choices = SpeculationChoices(drafters, spec.method, Router() if use_router else None, profile)
    state = ServerState(engine, name, metrics, choices, max_queued_requests, api_key, audit_rate)
    if audit_rate > 0:
        from .audit import Auditor

        state.auditor = Auditor(engine, audit_rate, metrics)
    state.tokenizer = target.tokenizer
    state.sampling_defaults = sampling_defaults(target.source.path, log)
    return state


SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k")  # those of generation_config.json a request may leave out


def sampling_defaults(model_dir, log=None) -> dict:
    """temperature, top_p and top_k from a checkpoint's generation_config.json where they
    differ from transformers' defaults, as vLLM takes them (``--generation-config auto``,
    its default): a request that leaves one out gets the model's (found in review: a
    Llama 3 Instruct directory's 0.6 / 0.9 were ignored, and requests sampled at 1.0 / 1.0).
    A setting we cannot apply (a repetition penalty, min_p) is named in the log."""
    from pathlib import Path

    from transformers import GenerationConfig

    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        values = GenerationConfig.from_pretrained(str(path.parent)).to_diff_dict()
    except (OSError, ValueError, TypeError) as error:
        raise ConfigError(f"{path} could not be read: {error}") from None
    defaults = {name: values[name] for name in SAMPLING_DEFAULTS if values.get(name) is not None}
    try:
        # the values requests get, as numbers of the right kind: a "top_k": 40.0 kept as a float
        # failed every request that left top_k out, and each such failure aborted the batch
        # (found in review); a top_k that is not a whole number is refused
        defaults = {name: (float(value) if name != "top_k" else value) for name, value in defaults.items()}
        if "top_k" in defaults:
            top_k = defaults["top_k"]
            if isinstance(top_k, bool) or float(top_k) != int(top_k):
                raise ValueError(f"top_k must be a whole number, got {top_k!r}")
            defaults["top_k"] = max(int(top_k), 0)
        SamplingParams(temperature=defaults.get("temperature", 1.0), top_p=defaults.get("top_p", 1.0),
                       top_k=defaults.get("top_k", 0))
    except (ConfigError, TypeError, ValueError, OverflowError) as error:
        raise ConfigError(f"{path}: its sampling defaults are not usable ({error})") from None
    ignored = [name for name in ("repetition_penalty", "min_p") if values.get(name) not in (None, 1.0, 0.0)]
    if log is not None and (defaults or ignored):
        log(f"sampling defaults from {path.name} for requests that leave them out: {defaults or 'none'}"
            + (f"; not applied (not supported): {', '.join(ignored)}" if ignored else ""))
    return defaults


def serving_threads() -> int:
    """Kernel threads for a server: every core torch would use but one. The event loop
    (HTTP, streaming, detokenizing) runs beside the engine thread, and a kernel whose team
    of threads is preempted waits at each barrier for the one descheduled: on a 2-core Zen
    4, one kernel thread served 171 tok/s to one client where two served 79; on a 2-core Zen
    3 two served 8 clients faster (docs/serving.md). So by default decode passes choose
    between this and every core by measuring them (``control.threads``); this count is the
    one the cost profile is measured at (per thread count: the first start at a new count
    measures one) and the one a pass runs at until both are measured."""
    import torch

    return max(1, torch.get_num_threads() - 1)


def serve(state: ServerState, host: str, port: int, shutdown_timeout: float) -> None:
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # from the signal on, a request on a connection still open gets a 503 with
            # Retry-After (new connections are refused) while the in-flight ones drain
            state.accepting = False
            super().handle_exit(sig, frame)

    app = create_app(state, state.tokenizer)
    Server(uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=shutdown_timeout,
                          log_level="info")).run()


def ray_application(engine_config: EngineConfig, speculative: str | None, replicas: int, max_num_seqs: int,
                    max_queued_requests: int, shutdown_timeout: float = 30.0, **state_kwargs):
    """The same app on Ray Serve: ``replicas`` replicas, each loading its own engine.

    Overload is each replica's to answer, with the OpenAI error JSON and Retry-After that
    a single server sends: Ray routes a replica at most one request more than it holds
    (``max_ongoing_requests`` = ``max_num_seqs + max_queued_requests + 1``), which the replica
    refuses itself, and Ray's proxy queues without a limit of its own, which only fills for
    the moment every replica is refusing one. Found in review: Ray's own limit answered
    half the 503s of a burst in plain text, without Retry-After, and let one request more
    than ``--max-queued-requests 0`` through to wait.
    ``shutdown_timeout``: how long a replica being stopped lets its requests finish
    (Ray's ``graceful_shutdown_timeout_s``; found in review: not passed on)."""
    try:
        from ray import serve
    except ImportError:
        raise ConfigError("--replicas needs Ray Serve: pip install 'specdecode[ray]'") from None
    if replicas < 1:
        raise ConfigError(f"--replicas must be >= 1, got {replicas}")
    spec, _ = parse_speculative_config(speculative)  # a bad config named here, not in each replica's log after Ray started
    check_serve_options(max_num_seqs, max_queued_requests, state_kwargs.get("audit_rate", 0.0),
                        state_kwargs.get("schedule", "fcfs"), state_kwargs.get("api_key"))
    check_drafter_files(spec, engine_config.model)

    threads = engine_config.num_threads or max(1, (os.cpu_count() or 1) // replicas)  # replicas share the cores

    def build():
        import torch

        torch.set_num_threads(threads)
        state = build_state(engine_config, speculative, max_num_seqs, max_queued_requests, **state_kwargs)
        state.metrics.constant_labels = {"replica": FINGERPRINT}  # the proxy answers a scrape from one replica
        state.start()  # whether or not the ingress runs the app's lifespan
        return create_app(state, state.tokenizer)

    deployment = serve.deployment(serve.ingress(build)(), name="specdecode")
    return deployment.options(num_replicas=replicas, max_ongoing_requests=max_num_seqs + max_queued_requests + 1,
                              max_queued_requests=-1,
                              graceful_shutdown_timeout_s=max(shutdown_timeout, 0.0),
                              ray_actor_options={"num_cpus": 0}).bind()


def serve_ray(application, host: str, port: int) -> None:
    """Deploy on a local Ray instance (or the cluster RAY_ADDRESS names) and block."""
    import ray
    from ray import serve

    ray.init(include_dashboard=False, ignore_reinit_error=True)
    # SIGTERM (and Ctrl-C) stop the deployment as Ray stops a replica: requests in flight
    # finish for up to the deployment's graceful_shutdown_timeout_s. Found in review: the
    # driver blocked in Ray's wait, which takes Ctrl-C only, and SIGTERM cut every stream.
    # Set after ray.init (whose own handler ends the driver at once) and before the
    # deployment can take a request.
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    serve.start(http_options={"host": host, "port": port})
    serve.run(application, name="specdecode", route_prefix="/", blocking=False)
    while not stop.wait(1.0):
        pass
    print("specdecode: stopping; requests in flight may finish (--shutdown-timeout)", file=sys.stderr, flush=True)
    serve.delete("specdecode")  # the replicas drain behind a proxy that still streams their replies
    time.sleep(2.0)  # the proxy's last chunks on their way out (a loaded machine cut the tail before [DONE])
    serve.shutdown()
    ray.shutdown()
