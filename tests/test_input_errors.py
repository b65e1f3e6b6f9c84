"""Bad input to the CLI: one clear error line (exit 2), before any model loads, never a
traceback or a silently wrong answer."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from specdecode.cli import main
from specdecode.config import SpecDecodeError
from specdecode.prompts import load_prompts


def run(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


@pytest.mark.parametrize("record, problem", [
    ({"prompt": 5}, "'prompt' must be a string or a non-empty list of strings, got 5"),
    ({"prompt": None}, "'prompt' must be a string or a non-empty list of strings, got None"),
    ({"prompt": "  "}, "the prompt is empty"),
    ({"turns": [1, "b"]}, "'turns' must be a string or a non-empty list of strings"),
    ({"turns": []}, "'turns' must be a string or a non-empty list of strings, got []"),
    ({"turns": ["fine", " "]}, "turn 2 is empty"),
    ({"prompt": "hi", "category": ["a"]}, "'category' must be a string, got ['a']"),
    ({"prompt": "hi", "question_id": {"a": 1}}, "'question_id' must be a string or an integer"),
    ({"prompt": "again", "category": "c", "question_id": "c-1"}, "question_id 'c-1' is also the id of line 1"),
])
def test_bench_refuses_a_bad_prompt_record_by_file_and_line(tmp_path, capsys, tiny_llama_dir, record, problem):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "fine", "category": "c"}) + "\n" + json.dumps(record) + "\n")
    code, err = run(capsys, "bench", "--prompts", str(path), "--model", str(tiny_llama_dir), "--max-new-tokens", "2")
    assert code == 2
    assert f"specdecode: error: {path} line 2: {problem}" in err


def test_spec_bench_records_load_and_a_string_turn_is_the_whole_prompt(tmp_path):
    path = tmp_path / "question.jsonl"
    path.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["Write.", "Again."]}) + "\n"
                    + json.dumps({"turns": "hello world"}) + "\n")
    assert load_prompts(str(path)) == [
        {"question_id": 81, "category": "writing", "prompt": "Write.", "turns": ["Write.", "Again."]},
        {"question_id": "general-1", "category": "general", "prompt": "hello world", "turns": ["hello world"]}]


@pytest.mark.parametrize("flags", [["--k", "3"], ["--k-policy", "threshold"], ["--k-max", "4"]])
def test_profile_refuses_k_policy_flags_it_would_ignore(capsys, flags):
    code, err = run(capsys, "profile", *flags, "--model", "/nowhere/model")
    assert code == 2 and f"{flags[0]} would be ignored" in err


@pytest.mark.parametrize("methods", ["none", "ngram,eagle", "bogus"])
def test_profile_refuses_what_is_not_a_drafter_before_loading(capsys, methods):
    code, err = run(capsys, "profile", "--methods", methods, "--draft", "self:7", "--model", "/nowhere/model")
    assert code == 2
    assert f"profile --methods takes a comma list of ('ngram', 'draft'), got {methods!r}" in err


def test_check_refuses_a_bad_layer_skip_drafter_and_takes_a_good_one(capsys, tiny_llama_dir):
    for draft, problem in [("self:x", "draft self:L needs an integer layer count, got 'self:x'"),
                           ("self:2", "draft self:L needs 1 <= L < 2 (the target's layers), got 2"),
                           ("self:0", "draft self:L needs 1 <= L < 2 (the target's layers), got 0")]:
        code, err = run(capsys, "check", str(tiny_llama_dir), draft, "--no-calibration")
        assert code == 2 and problem in err, (draft, err)
    assert main(["check", str(tiny_llama_dir), "self:1", "--no-calibration"]) == 0
    assert "verdict: COMPATIBLE" in capsys.readouterr().out


def test_memory_refuses_bad_drafters_and_chunks_and_takes_good_ones(capsys):
    memory = ("memory", "--target", "135M", "--no-process", "--budget", "100")
    for flags, problem in [(["--draft", "self:x"], "draft self:L needs an integer layer count, got 'self:x'"),
                           (["--draft", "self:30"], "draft self:L needs 1 <= L < 30 (the target's layers), got 30"),
                           (["--prefill-chunk", "0"], "prefill_chunk must be an integer in 1..512, got 0"),
                           (["--prefill-chunk", "100000"], "prefill_chunk must be an integer in 1..512, got 100000")]:
        code, err = run(capsys, *memory, *flags)
        assert code == 2 and problem in err, (flags, err)
    assert main([*memory, "--draft", "self:29", "--prefill-chunk", "512"]) == 0
    assert "the target's first 29 layers" in capsys.readouterr().out


def test_bench_refuses_an_empty_method_list(capsys):
    code, err = run(capsys, "bench", "--methods", " , ", "--model", "/nowhere/model")
    assert code == 2 and "--methods takes a comma list of methods, got ' , '" in err


def test_transformers_runtime_refuses_the_native_runtimes_flags(tiny_llama_dir):
    """--backend kernels with --runtime hf ran on transformers and said nothing."""
    import torch

    from specdecode.config import ConfigError
    from specdecode.factory import load_model

    for flags in ({"backend": "kernels"}, {"backend": "torch"}, {"weights": "int4"}, {"exact": True}):
        with pytest.raises(ConfigError, match="runs through transformers, which takes neither"):
            load_model(str(tiny_llama_dir), torch.float32, runtime="hf", **flags)


@pytest.mark.parametrize("argv, problem", [
    (["generate", "hi", "--method", "ngram", "--store", "/tmp"], "--store is read by method suffix only; ngram would ignore it"),
    (["generate", "hi", "--method", "suffix", "--tree-width", "2"], "--tree-width is read by method eagle or tree only"),
    (["bench", "--methods", "none,ngram@3", "--head", "/tmp"], "--head is read by method eagle or tree or medusa only; none, ngram would ignore it"),
    (["profile", "--methods", "ngram", "--store", "/tmp"], "--store is read by method suffix only"),
    (["generate", "hi", "--method", "suffix", "--draft", "self:2"], "--draft is read by method draft only; suffix would ignore it"),
    (["bench", "--methods", "none,ngram", "--draft", "self:2"], "--draft is read by method draft only; none, ngram would ignore it"),
    (["generate", "hi", "--method", "ngram", "--k", "3x2"], "a tree width is for eagle and tree; ngram drafts chains"),
    (["bench", "--methods", "none,suffix@4x2"], "a tree width is for eagle and tree; suffix drafts chains"),
])
def test_a_drafter_flag_no_method_reads_is_refused_before_loading(capsys, argv, problem):
    """`--method ngram --store DIR` ran prompt lookup alone and said nothing of the store."""
    code, err = run(capsys, *argv, "--model", "/nowhere/model")
    assert code == 2 and problem in err, err


def test_a_drafter_flag_is_taken_when_one_of_the_bench_methods_reads_it(capsys):
    """bench --methods none,eagle@4 --tree-width 3 reads the flag (a spec without a width of
    its own): it gets past the check and fails later, on the model path. Beside eagle@4x2
    the flag would be ignored (found in review: it ran at width 2), and is refused."""
    code, err = run(capsys, "bench", "--methods", "none,eagle@4", "--tree-width", "3", "--model", "/nowhere/model")
    assert code == 2 and "is read by" not in err and "/nowhere/model" in err, err
    code, err = run(capsys, "bench", "--methods", "none,eagle@4x2", "--tree-width", "3", "--model", "/nowhere/model")
    assert code == 2 and "eagle@4x2 and --tree-width 3 give two tree widths" in err, err


def test_method_draft_without_draft_flag_uses_the_first_four_layers():
    from specdecode.cli import _spec_config, build_parser

    args = build_parser().parse_args(["generate", "hi", "--method", "draft"])
    assert args.draft is None and _spec_config(args, "draft").draft == "self:4"
    args = build_parser().parse_args(["generate", "hi", "--method", "draft", "--draft", "self:2"])
    assert _spec_config(args, "draft").draft == "self:2"
    # an empty --draft is refused (found in review: it ran self:4 without a word)
    for empty in ("", "  "):
        args = build_parser().parse_args(["generate", "hi", "--method", "draft", "--draft", empty])
        with pytest.raises(SpecDecodeError, match="--draft is empty"):
            _spec_config(args, "draft")


def test_train_store_and_export_take_no_seed(capsys):
    """Found in review: both took --seed and read it nowhere; the verbs that draw take it."""
    from specdecode.cli import build_parser

    for verb in ("store", "export"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["train", verb, "--out", "x", "--seed", "5"])
        assert "unrecognized arguments: --seed 5" in capsys.readouterr().err
    assert build_parser().parse_args(["train", "data", "--seed", "5"]).seed == 5


def _broken_copy(source, target, how: str):
    import shutil

    shutil.copytree(source, target)
    if how == "config not JSON":
        (target / "config.json").write_text("{bad")
    elif how == "config without hidden_size":
        config = json.loads((target / "config.json").read_text())
        del config["hidden_size"]
        (target / "config.json").write_text(json.dumps(config))
    else:  # a safetensors file cut short
        data = (target / "model.safetensors").read_bytes()
        (target / "model.safetensors").write_bytes(data[: len(data) // 2])
    return target


@pytest.mark.parametrize("how, problem", [
    ("config not JSON", "config.json is not valid JSON"),
    ("config without hidden_size", "config.json has no positive integer for hidden_size"),
    ("safetensors cut short", "model.safetensors is not a readable safetensors file"),
])
def test_a_damaged_checkpoint_gets_one_line_naming_the_file(tmp_path, capsys, tiny_llama_dir, how, problem):
    """Found in review: each of these ended in a traceback from json or safetensors."""
    model = _broken_copy(tiny_llama_dir, tmp_path / "m", how)
    code, err = run(capsys, "generate", "hi", "--model", str(model), "--no-chat-template", "--max-new-tokens", "2",
                    "--weights", "fp32", "--k", "1")
    assert code == 2 and problem in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv, problem", [
    (["--port", "99999"], "--port must be in 1..65535, got 99999"),
    (["--port", "0"], "--port must be in 1..65535, got 0"),
    (["--max-model-len", "-5"], "--max-model-len must be >= 1, got -5"),
    (["--max-model-len", "0"], "--max-model-len must be >= 1, got 0"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be >= 0 seconds, got -1.0"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),  # was after the load and calibration
    (["--replicas", "2", "--device", "cuda"], "--replicas runs CPU replicas"),
])
def test_serve_refuses_a_bad_port_or_context_before_loading(capsys, argv, problem):
    """Found in review: port 99999 was announced and another port bound; -5 crashed in torch,
    0 silently meant the model's context."""
    code, err = run(capsys, "serve", *argv)
    assert code == 2 and problem in err


def test_a_context_longer_than_the_models_is_refused(tiny_llama_dir):
    """--max-model-len beyond the model's context was silently cut to it."""
    import torch

    from specdecode.config import SpecDecodeError
    from specdecode.models.llama import load_native
    from specdecode.serve.batch import BatchEngine

    runtime = load_native(tiny_llama_dir, torch.float32)
    with pytest.raises(SpecDecodeError, match=rf"max_model_len 100000 is outside 1..{runtime.max_positions}"):
        BatchEngine(runtime, max_num_seqs=1, max_model_len=100_000)


def test_a_transformers_draft_model_does_not_take_the_targets_flags(tmp_path, tiny_llama_dir):
    """Found in review: --backend torch (meant for the target) was refused for a gpt2 draft
    model that runs through transformers, with a message about the draft's flags."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdecode.config import EngineConfig, SamplingParams, SpeculativeConfig
    from specdecode.engine import SpeculativeEngine
    from specdecode.factory import build_engine, load_model

    config = AutoConfig.for_model("gpt2", vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=128)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gpt2")
    engine = build_engine(EngineConfig(model=str(tiny_llama_dir), dtype="fp32", backend="torch", weights="fp32"),
                          SpeculativeConfig(method="draft", draft=str(tmp_path / "gpt2"), k=2))
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    plain = SpeculativeEngine(load_model(str(tiny_llama_dir), torch.float32, backend="torch").runtime)
    assert engine.generate([5, 6, 7], params).token_ids == plain.generate([5, 6, 7], params).token_ids


@pytest.mark.parametrize("argv, problem", [
    (["generate", "hi", "--k", "5", "--k-max", "3"], "--k-max choose k under --k auto; --k 5 fixes it"),
    (["generate", "hi", "--k", "5", "--k-policy", "threshold"], "--k-policy choose k under --k auto"),
    (["generate", "hi", "--method", "none", "--k", "4"], "--k 4 would be ignored: none drafts nothing with it"),
    (["bench", "--methods", "none,hf", "--k", "3"], "--k 3 would be ignored: none, hf draft nothing with it"),
    (["bench", "--methods", "none,ngram@x"], "'ngram@x': k is an integer, auto or threshold"),
    (["bench", "--methods", "none", "--limit", "0"], "--limit must be at least 1, got 0"),
    (["bench", "--methods", "none,ngram", "--out", "/proc/nowhere/b.json"], "--out /proc/nowhere/b.json: cannot write there"),
    (["analyze", "--out", "/proc/nowhere"], "--out /proc/nowhere/summary.md: cannot write there"),
    (["analyze", "--batch", "0"], "--batch must be at least 1, got 0"),
    (["analyze", "--budget", "-2"], "--budget must be a finite number > 0 GiB, got -2.0"),
    (["analyze", "--methods", "ngram,hf"], "--methods hf: analyze measures drafters against plain decoding"),
    (["bench-serve", "--max-tokens", "0"], "--max-tokens and --num-prompts must be at least 1"),
    (["bench-serve", "--serve-args", '"unterminated'], "--serve-args '\"unterminated': No closing quotation"),
    (["generate", "hi", "--method", "eagle", "--tree-width", "300"], "must be an integer in 1..64, got 300"),
    # found in review: each accepted and ignored, or a hang, or refused only after loading
    (["generate", "hi", "--method", "none", "--k-max", "3"], "--k-max would be ignored: none drafts nothing with it"),
    (["generate", "hi", "--method", "none", "--k-policy", "threshold"], "--k-policy would be ignored: none drafts"),
    (["generate", "hi", "--method", "draft", "--ngram-sizes", "7"], "--ngram-sizes is read by method ngram or suffix "
                                                                     "or tree only; draft would ignore it"),
    (["generate", "hi", "--method", "eagle", "--k", "6x2", "--tree-width", "4"], "give two tree widths"),
    (["generate", "hi", "--k-max", "100000000"], "k_max must be an integer in 1..512, got 100000000"),
    (["generate", "hi", "--method", "ngram", "--ngram-sizes", "10000000000000000000000"],
     "ngram_sizes must be at most 64 integers in 1..64"),
    (["analyze", "--temperature", "0.9"], "--temperature 0.9: analyze runs every temperature --temperatures lists"),
    (["analyze", "--temperatures", "nan"], "--temperatures needs at least one value, each a finite number >= 0"),
    # found in review (2026-11-27): each ran, ignoring the flag, or failed at the end with a traceback
    (["bench", "--methods", "none,ngram@"], "'ngram@': give k after the @"),
    (["bench", "--methods", "none,ngram@1000"], "ngram@1000: k (draft tokens per step) must be 'auto' or an integer"),
    (["bench", "--methods", "none,eagle@6x99999"], "eagle@6x99999: tree width"),
    (["bench", "--methods", "none,ngram", "--k", "1000"], "k (draft tokens per step) must be 'auto' or an integer"),
    (["bench", "--methods", "none,ngram@3", "--ngram-sizes", "100"], "error: ngram_sizes must be at most 64"),
    (["bench", "--methods", "none,ngram@3", "--k-max", "5"], "--k-max choose k under k auto; none, ngram@3 fix it"),
    (["bench", "--methods", "none,eagle@6x3", "--tree-width", "2"], "eagle@6x3 and --tree-width 2 give two tree widths"),
    (["analyze", "--methods", "none"], "analyze measures drafters against plain decoding; name one"),
    (["analyze", "--out", ""], "--out is empty"),
    (["train", "data", "--out", " "], "--out is empty"),
    (["train", "eagle", "--corpus-tokens", "-1"], "--corpus-tokens must be >= 0, got -1"),
    (["profile", "--methods", ""], "profile --methods takes a comma list"),
    (["serve", "--api-key", ""], "--api-key is empty"),
    (["bench-serve", "--request-rate", "2", "--concurrency", "3"], "--concurrency 3 is for closed-loop runs"),
    (["bench-serve", "--request-rate", "2", "--concurrency", "1,2,4,8"], "--concurrency 1,2,4,8 is for closed-loop"),
    (["bench", "--methods", "none,ngram", "--out", ""], "--out is empty"),
])
def test_flags_a_run_would_ignore_or_fail_on_late_are_refused_first(capsys, argv, problem):
    """Found in review: flags ignored without a word (a fixed --k beside --k-max, --k with
    nothing that drafts), a bad --out found after the whole run, --max-tokens 0 giving a table
    of zeros, and tracebacks from a bad --serve-args or --tree-width."""
    code, err = run(capsys, *argv, "--model", "/nowhere/model") if argv[0] != "bench-serve" else run(capsys, *argv)
    assert code == 2 and problem in err, err


def test_budgets_ks_and_prompts_a_command_cannot_mean_are_refused_first(capsys):
    memory = ("memory", "--target", "135M", "--no-process")
    code, err = run(capsys, *memory, "--budget", "-1")
    assert code == 2 and "--budget must be a finite number > 0 GiB, got -1.0" in err, err
    code, err = run(capsys, *memory, "--budget", "inf")  # "fits" anything (found in review)
    assert code == 2 and "--budget must be a finite number > 0 GiB, got inf" in err, err
    code, err = run(capsys, *memory, "--k", "1000000000")  # reported 183,105 GiB
    assert code == 2 and "--k must be in 0..512" in err, err
    code, err = run(capsys, "check", "a", "b", "--no-calibration", "--k", "-2")  # accepted without calibration
    assert code == 2 and "--k must be >= 1, got -2" in err, err
    code, err = run(capsys, "generate", " ", "--model", "/nowhere/model")  # found after loading and calibrating
    assert code == 2 and "the prompt is empty" in err, err
    code, err = run(capsys, *memory, "--context", "100000")
    assert code == 2 and "--context 100000 is beyond the model's 8192 positions" in err, err


def test_a_reader_that_leaves_a_pipe_ends_the_command_quietly(monkeypatch, capsys):
    """Found in review: `specdecode generate ... | head` ended in a BrokenPipeError traceback."""
    from specdecode import cli

    def reader_gone(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "cmd_generate", reader_gone)
    assert cli.main(["generate", "hi"]) == 141 and "Traceback" not in capsys.readouterr().err


def test_bench_specs_with_auto_or_threshold_and_a_tree_width_still_parse():
    """The k check of bench specs (review) first refused eagle@autox1, which a recorded run
    of docs/bench/suite-trees.json used."""
    from specdecode.bench.runner import parse_method

    assert parse_method("eagle@autox1") == ("eagle", "autox1")
    assert parse_method("tree@thresholdx3") == ("tree", "thresholdx3")
    assert parse_method("eagle@6x3") == ("eagle", "6x3") and parse_method("ngram@auto") == ("ngram", "auto")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the server would start")
def test_serve_takes_a_device_and_names_a_missing_gpu(capsys, tiny_llama_dir):
    """serve had no --device (generate and bench had): a GPU could not serve."""
    code, err = run(capsys, "serve", "--model", str(tiny_llama_dir), "--device", "cuda")
    assert code == 2 and "device 'cuda' asked for, but torch sees no CUDA GPU here" in err and "Traceback" not in err


def test_public_prompt_layouts_load(tmp_path, capsys):
    """Public sets come in other layouts than Spec-Bench's: GSM8K's question, Alpaca's
    instruction and input, ShareGPT's conversations (one JSON array) and chat messages.
    Each loads with its user turns; before, every one of them was refused."""
    jsonl = tmp_path / "mixed.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in [
        {"question": "What is 2 + 3?", "answer": "5"},
        {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"},
        {"instruction": "Name a colour.", "input": ""},
        {"task_id": "HumanEval/0", "prompt": "def add(a, b):\n"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]},
    ]) + "\n")
    loaded = load_prompts(str(jsonl))
    assert [p["turns"] for p in loaded] == [["What is 2 + 3?"], ["Translate to French.\n\nGood morning"],
                                            ["Name a colour."], ["def add(a, b):\n"], ["Hi", "Bye"]]
    assert loaded[3]["question_id"] == "HumanEval/0"
    assert loaded[4]["system"] == "Be brief." and all("system" not in p for p in loaded[:4])  # kept (found in review)
    jsonl.write_text(json.dumps({"question_id": 5, "id": None, "prompt": "x"}) + "\n")  # only the id used is checked
    assert load_prompts(str(jsonl))[0]["question_id"] == 5
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([
        {"id": "a1", "conversations": [{"from": "human", "value": "Tell me a joke."}, {"from": "gpt", "value": "..."},
                                       {"from": "human", "value": "Another."}]},
        {"id": "a2", "conversations": [{"from": "human", "value": "Why is the sky blue?"}]},
    ]))
    assert [(p["question_id"], p["turns"]) for p in load_prompts(str(sharegpt))] == [
        ("a1", ["Tell me a joke.", "Another."]), ("a2", ["Why is the sky blue?"])]
    # public dumps hold broken conversations: left out and counted (found in review), as vLLM's benchmarks do
    sharegpt.write_text(json.dumps([{"id": "a1", "conversations": [{"from": "gpt", "value": "no question"}]},
                                    {"id": "a2", "conversations": []},
                                    {"id": "a3", "conversations": [{"from": "human", "value": ""}]},
                                    {"id": "a4", "conversations": [{"from": "human", "value": "Fine."}]}]))
    assert [p["question_id"] for p in load_prompts(str(sharegpt))] == ["a4"]
    assert "left out 3 record(s)" in capsys.readouterr().err
    sharegpt.write_text(json.dumps([{"id": "a1", "conversations": [{"from": "gpt", "value": "no question"}]}]))
    with pytest.raises(SpecDecodeError, match="holds no prompts"):
        load_prompts(str(sharegpt))
    assert "record 1: 'conversations' holds no user turn" in capsys.readouterr().err
    sharegpt.write_text("[{\"id\": 1,")
    with pytest.raises(SpecDecodeError, match="is not JSON"):
        load_prompts(str(sharegpt))
    jsonl.write_text(json.dumps({"text": "unknown layout"}) + "\n")
    with pytest.raises(SpecDecodeError, match=r"line 1: expected .*\{question\} \(GSM8K\)"):
        load_prompts(str(jsonl))


def test_compare_where_plain_decoding_makes_no_token(capsys, tiny_text_model_dir):
    """Found in review: a prompt whose first greedy token is EOS made `generate --compare`
    divide by plain decoding's 0 tok/s (a traceback); the speedup is then null."""
    code = main(["generate", "bs", "--model", str(tiny_text_model_dir), "--method", "ngram", "--k", "3", "--compare",
                 "--no-chat-template", "--json", "--dtype", "fp32"])
    captured = capsys.readouterr()
    assert code == 0 and "Traceback" not in captured.err, captured.err
    record = json.loads(captured.out)
    assert record["plain"]["new_tokens"] == 0 and record["speedup"] is None


def test_more_bad_input_is_one_clear_error(tmp_path, capsys, tiny_llama_dir):
    """Found in review, each a traceback (or a wasted run) before: --out naming a directory
    (checked as writable, the report then failed to write at the end), --methods ","
    (every plain run, then a plot of nothing), --request-rate nan (every request at once),
    a prompts file that is not UTF-8, --threads far above the machine's cores, a train
    --out that cannot be written (after the target loaded)."""
    model = str(tiny_llama_dir)
    (tmp_path / "dir").mkdir()
    prompts = tmp_path / "latin.jsonl"
    prompts.write_bytes(b'\xff\xfe{"prompt": "caf\xe9"}\n')
    for argv, problem in (
            (("bench", "--model", model, "--out", str(tmp_path / "dir")), "is a directory"),
            (("bench-serve", "--out", str(tmp_path / "dir"), "--url", "http://127.0.0.1:9"), "is a directory"),
            (("analyze", "--model", model, "--methods", ",", "--out", str(tmp_path / "a")), "--methods takes a comma list"),
            (("bench-serve", "--request-rate", "nan", "--url", "http://127.0.0.1:9"), "--request-rate must be a finite"),
            (("bench", "--model", model, "--prompts", str(prompts)), "cannot be read as UTF-8"),
            (("generate", "--model", model, "--threads", "100000", "hi"), "more than 4x this machine"),
            (("train", "data", "--model", model, "--out", "/proc/specdecode-nope"), "--out /proc/specdecode-nope")):
        code, err = run(capsys, *argv)
        assert code == 2 and problem in err and "Traceback" not in err, (argv, err)


def test_bench_names_a_prompt_beyond_the_context_before_running(tmp_path, capsys, tiny_text_model_dir):
    """Found in review: the third prompt of a file, 400 tokens on a 256-token model, failed
    the run when it got there (4 of 6 runs done, nothing written), without its name."""
    path = tmp_path / "prompts.jsonl"
    rows = [{"question_id": "short", "prompt": "abc"}, {"question_id": "long-one", "prompt": "ab" * 200}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    code, err = run(capsys, "bench", "--prompts", str(path), "--model", str(tiny_text_model_dir), "--methods", "none",
                    "--max-new-tokens", "2", "--no-chat-template")
    assert code == 2 and "prompt 'long-one': prompt has" in err and "context is 256 tokens" in err, err
    assert "bench:" not in err  # no run started


def test_text_that_is_not_utf8_is_one_clear_error(capsys, tiny_text_model_dir):
    """Found in review: argv bytes that are not UTF-8 arrive as lone surrogates; the prompt
    ended in the tokenizer's TypeError (a traceback), and such a --stop could never match."""
    model = str(tiny_text_model_dir)
    code, err = run(capsys, "generate", "caf\udce9", "--model", model, "--no-chat-template", "--max-new-tokens", "2")
    assert code == 2 and "not valid UTF-8" in err and "b'\\xe9'" in err and "Traceback" not in err, err
    code, err = run(capsys, "generate", "abc", "--model", model, "--stop", "\udce9", "--max-new-tokens", "2")
    assert code == 2 and "is not valid UTF-8" in err and "Traceback" not in err, err


def test_broken_tokenizer_and_generation_config_files_are_named(tmp_path):
    """Found in review: a corrupt tokenizer.json, a generation_config.json that is not JSON
    or holds its EOS id as a string, and a config.json transformers does not know, each
    ended in a traceback from inside transformers or the factory."""
    import shutil

    from specdecode.factory import load_model
    from specdecode.models.loading import ModelNotFoundError

    from conftest import save_chat_model

    source = save_chat_model(tmp_path / "chat", seed=1)
    for name, content, problem in (("tokenizer.json", "{not json", "its tokenizer cannot be loaded"),
                                   ("generation_config.json", "{not json", "is not valid JSON"),
                                   ("generation_config.json", '{"eos_token_id": "2"}', "eos_token_id must be an integer")):
        broken = tmp_path / f"broken-{len(problem)}"
        shutil.copytree(source, broken)
        (broken / name).write_text(content)
        with pytest.raises(SpecDecodeError, match=problem):
            load_model(str(broken), torch.float32).eos_token_ids
    unknown = tmp_path / "unknown"
    shutil.copytree(source, unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "foobar"}))
    with pytest.raises(ModelNotFoundError, match="transformers cannot load it|model_type"):
        load_model(str(unknown), torch.float32)


@pytest.mark.parametrize("field, value", [("max_position_embeddings", "256"), ("rms_norm_eps", "1e-6"),
                                          ("num_key_value_heads", "2"), ("rope_theta", "10000"),
                                          ("tie_word_embeddings", "false"), ("head_dim", 0)])
def test_wrongly_typed_optional_config_fields_are_named(tmp_path, field, value):
    """Found in review: these crashed inside the runtime (a TypeError from torch.arange, a
    string rms_norm_eps in the kernels), or read "false" as true."""
    import shutil

    from conftest import save_tiny_model
    from specdecode.models.llama import load_native

    source = save_tiny_model(tmp_path / "t", seed=2)
    broken = tmp_path / "broken"
    shutil.copytree(source, broken)
    config = json.loads((broken / "config.json").read_text())
    if field == "rope_theta" and isinstance(config.get("rope_parameters"), dict):  # where transformers writes it
        config["rope_parameters"]["rope_theta"] = value
    (broken / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(SpecDecodeError, match=f"config.json holds {field} "):
        load_native(broken, torch.float32)
    if field in ("max_position_embeddings", "num_key_value_heads", "head_dim"):  # the memory estimate reads them too
        from specdecode.analysis.memory import resolve_shape

        with pytest.raises(SpecDecodeError, match=f"config.json holds {field} "):
            resolve_shape(str(broken))


def test_flags_and_configs_that_were_ignored_or_crashed_are_taken_or_refused(tmp_path, capsys, tiny_text_model_dir):
    """Found in review: --prefill-chunk below 8 crashed the default generate (the cost
    profile timed the output head on a pass it had split); a preset's n-gram sizes read as
    a flag the user gave; --runtime hf ignored --prefill-chunk; a fixed k had no bound (a
    served 100,000 made as many /metrics series); serve's config took keys its method
    ignores; --preset '' was ignored."""
    from specdecode.config import ConfigError, SpeculativeConfig
    from specdecode.serve.server import parse_speculative_config

    model = str(tiny_text_model_dir)
    common = ("--model", model, "--dtype", "fp32", "--no-chat-template", "--max-new-tokens", "6", "--threads", "1")
    code, err = run(capsys, "generate", "abcabcabc", *common, "--method", "ngram", "--prefill-chunk", "2")
    assert code == 0, err
    code, err = run(capsys, "generate", "abcabcabc", *common, "--preset", "code-assistant", "--method", "draft",
                    "--draft", "self:1")
    assert code == 0, err
    code, err = run(capsys, "generate", "abcabcabc", *common, "--method", "ngram", "--ngram-sizes", "2",
                    "--runtime", "hf", "--prefill-chunk", "7")
    assert code == 2 and "nor --prefill-chunk" in err, err
    code, err = run(capsys, "generate", "abcabcabc", *common, "--preset", "")
    assert code == 2 and "unknown preset ''" in err, err
    # found in review: cut at the context (256 here) without a word, as if the budget had run out
    code, err = run(capsys, "generate", "abcabcabc", *common[:-4], "--max-new-tokens", "1000", "--method", "ngram")
    assert code == 0 and "exceed the model's context of 256 tokens: at most 247 new tokens" in err, err
    with pytest.raises(ConfigError, match="1..512"):
        SpeculativeConfig(method="ngram", k=100_000)
    for bad, why in (('{"method": "ngram", "num_speculative_tokens": 100000}', "1..64"),
                     ('{"method": "eagle", "prompt_lookup_min": 4}', "ngram and suffix only"),
                     ('{"method": "none", "k_max": 3}', "k_max and k_policy would be ignored")):
        with pytest.raises(ConfigError, match=why):
            parse_speculative_config(bad)


def test_a_draft_model_on_the_targets_own_cache_and_a_k_of_another_type(tiny_llama_dir):
    """Found in review: a draft model handed the target's own runtime rewrote the target's
    cache (greedy output silently left plain decoding's); a numpy integer k (a sweep over
    np.arange) or a float was taken for a policy and failed later with an AttributeError."""
    import numpy as np

    from specdecode.config import ConfigError, SamplingParams
    from specdecode.engine import SpeculativeEngine
    from specdecode.factory import load_model
    from specdecode.proposers.draft_model import DraftModelProposer

    target = load_model(str(tiny_llama_dir), torch.float32, backend="torch")
    with pytest.raises(ConfigError, match="the target's own runtime"):
        SpeculativeEngine(target.runtime, proposer=DraftModelProposer(target.runtime), k=3)
    draft = load_model(str(tiny_llama_dir), torch.float32, backend="torch")
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    plain = SpeculativeEngine(target.runtime).generate([5, 9, 11], params).token_ids
    engine = SpeculativeEngine(target.runtime, proposer=DraftModelProposer(draft.runtime), k=np.int64(3))
    assert engine.generate([5, 9, 11], params).token_ids == plain
    for k in (3.0, True, "3"):
        with pytest.raises(ConfigError, match="k must be an integer"):
            SpeculativeEngine(target.runtime, proposer=DraftModelProposer(draft.runtime), k=k)


def test_check_reads_configs_under_the_names_transformers_gives_them(tmp_path, capsys):
    """Found in review: `check` read config.json's raw keys, so a GPT-2 target (n_layer) said
    "self:L needs 1 <= L < 0", and a multimodal config (vocabulary in its text config) read
    None for both models and passed."""
    from specdecode.analysis.compat import config_value

    assert config_value({"n_layer": 6}, "num_hidden_layers") == 6
    assert config_value({"text_config": {"vocab_size": 262208}}, "vocab_size") == 262208
    assert config_value({"vocab_size": True}, "vocab_size") is None
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", vocab_size=97, n_embd=32, n_layer=2, n_head=2)
                                     ).save_pretrained(tmp_path / "gpt2")
    code, err = run(capsys, "check", str(tmp_path / "gpt2"), "self:1", "--no-calibration")
    assert code == 2 and "self:L needs the native runtime" in err


def test_method_draft_without_a_draft_names_its_default_when_it_does_not_fit(capsys, tiny_text_model_dir):
    """Found in review: on a target of 4 layers or fewer, --method draft alone said "got 4"
    of a self:4 the user never typed. (A model with a tokenizer: without one, generate says
    that first.)"""
    code, err = run(capsys, "generate", "hi", "--model", str(tiny_text_model_dir), "--method", "draft", "--k", "2")
    assert code == 2 and "self:4 is --method draft's drafter when --draft is not given" in err


def test_profile_with_its_default_methods_runs_on_a_target_too_small_for_self_4(capsys, tiny_llama_dir):
    """Found in review: `specdecode profile --model M`, as docs/adaptive.md shows it, failed
    on any target of 4 layers or fewer (its default methods cost the self:4 draft)."""
    code, err = run(capsys, "profile", "--model", str(tiny_llama_dir), "--backend", "torch", "--dtype", "fp32")
    assert code == 0 and "not costing the default draft self:4" in err
    # found in review: the same two methods in the other order refused the model
    code, err = run(capsys, "profile", "--model", str(tiny_llama_dir), "--backend", "torch", "--dtype", "fp32",
                    "--methods", "draft,ngram")
    assert code == 0 and "not costing the default draft self:4" in err
    # the draft alone, asked for by name: refused, naming the default the user did not type
    code, err = run(capsys, "profile", "--model", str(tiny_llama_dir), "--backend", "torch", "--dtype", "fp32",
                    "--methods", "draft")
    assert code == 2 and "self:4 is --method draft's drafter when --draft is not given" in err


def test_more_bad_input_is_one_clear_line_before_anything_loads(tmp_path, capsys, tiny_llama_dir, monkeypatch):
    """Found in review: bench --out NAME.png wrote the plot over the records (exit 0);
    --serve-args with --port bound the server where bench-serve never looked (a 15-minute
    wait), and with --url they were dropped; a 13-digit train data --seed failed after the
    model loaded, naming a derived number; serve --prefill-threads had no bound (a segfault);
    Ctrl-C ended a run without a word."""
    model = str(tiny_llama_dir)
    for argv, problem in (
            (("bench", "--model", model, "--out", str(tmp_path / "r.png")), "give a .json name"),
            (("bench-serve", "--out", str(tmp_path / "s.PNG"), "--url", "http://127.0.0.1:9"), "give a .json name"),
            (("bench-serve", "--serve-args=--model x --port 8123"), "--serve-args may not set --port"),
            (("bench-serve", "--serve-args=--host=0.0.0.0"), "--serve-args may not set --host"),
            (("bench-serve", "--url", "http://127.0.0.1:9", "--serve-args=--max-num-seqs 2"), "give one of them"),
            (("train", "data", "--model", model, "--out", str(tmp_path / "d"), "--seed", str(10 ** 12)),
             "--seed must be in 0.."),
            (("serve", "--model", model, "--prefill-threads", "100000"), "--prefill-threads must be in 1..")):
        code, err = run(capsys, *argv)
        assert code == 2 and problem in err and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "d" / "answers.settings.json").exists()  # refused before the settings that bind a folder
    from specdecode import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_memory", interrupted)
    code, err = run(capsys, "memory", "--target", "135M")
    assert code == 130 and "specdecode: interrupted" in err


def test_a_kv_cache_too_large_for_memory_is_named_by_its_flags(tiny_llama_dir):
    """Found in review: serve --max-num-seqs 100000 ended in the allocator's traceback."""
    from specdecode.models.llama import load_native
    from specdecode.serve.batch import BatchEngine

    runtime = load_native(tiny_llama_dir, torch.float32, backend="torch")
    with pytest.raises(SpecDecodeError, match="lower --max-num-seqs or --max-model-len"):
        BatchEngine(runtime, max_num_seqs=10 ** 7)


def test_a_model_of_a_small_context_calibrates_within_it(tmp_path, capsys):
    """Found in review: on a model of 38 positions or fewer the calibration's room for the
    prompt went to 0 or below, ``[-room:]`` kept the whole calibration prompt, and every
    `generate` with the default --k auto failed, blaming the user's prompt."""
    import json

    from conftest import save_char_tokenizer, save_tiny_model

    path = save_tiny_model(tmp_path / "short", seed=3, num_layers=1)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32}))
    save_char_tokenizer(path)
    code = main(["generate", "abcabc", "--model", str(path), "--method", "ngram", "--max-new-tokens", "4",
                 "--dtype", "fp32", "--backend", "torch", "--no-chat-template"])
    assert code == 0, capsys.readouterr().err


@pytest.mark.parametrize("verb", [["generate", "hi"], ["bench"]])
def test_sampling_flags_a_greedy_run_would_ignore_are_refused(capsys, verb):
    """Found in review: `--top-k 40 --seed 1` without --temperature decoded greedily and
    exited 0. A preset's own top_p is a default, not a flag given."""
    for flags, named in ((["--top-k", "40", "--seed", "1"], "--top-k and --seed shape sampling"),
                         (["--top-p", "0.5"], "--top-p shapes sampling")):
        code, err = run(capsys, *verb, *flags, "--model", "/nowhere/model")
        assert code == 2 and named in err and "--temperature 0 decodes greedily" in err, err
    code, err = run(capsys, *verb, "--top-p", "0.5", "--temperature", "0.7", "--model", "/nowhere/model")
    assert code == 2 and "shapes sampling" not in err and "/nowhere/model" in err, err
    if verb[0] == "generate":  # bench takes no preset
        code, err = run(capsys, *verb, "--preset", "chat-assistant", "--temperature", "0", "--model", "/nowhere/model")
        assert code == 2 and "shapes sampling" not in err and "/nowhere/model" in err, err


def test_text_stdout_cannot_encode_comes_out_replaced_not_as_a_traceback(monkeypatch):
    """Found in review: `PYTHONIOENCODING=ascii specdecode generate "<Chinese>"` ended in a
    UnicodeEncodeError traceback from the streamed text."""
    import io

    raw = io.BytesIO()
    ascii_stdout = io.TextIOWrapper(raw, encoding="ascii")
    monkeypatch.setattr(sys, "stdout", ascii_stdout)
    assert main(["generate", "hi", "--k", "0", "--model", "/nowhere/model"]) == 2
    print("moon: \u6708", end="", flush=True)  # as cmd_generate streams text
    assert raw.getvalue() == b"moon: ?"


def test_top_k_of_minus_one_disables_it_as_the_server_takes_it(capsys):
    """Found in review: the server took vLLM's top_k -1 (disabled) and `generate` refused it."""
    from specdecode.cli import build_parser

    assert build_parser().parse_args(["generate", "hi", "--top-k", "-1"]).top_k == 0
    code, err = run(capsys, "generate", "hi", "--top-k", "-1", "--model", "/nowhere/model")  # greedy: nothing given
    assert code == 2 and "shapes sampling" not in err and "/nowhere/model" in err, err
    code, err = run(capsys, "generate", "hi", "--temperature", "1", "--top-k", "-2", "--model", "/nowhere/model")
    assert code == 2 and "top_k must be >= 0" in err, err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--top-k", "many"])
    assert "--top-k: must be an integer, got 'many'" in capsys.readouterr().err


def test_a_prompt_file_nested_too_deeply_is_refused_by_name(tmp_path):
    """Found in review: a RecursionError traceback, from a JSON array and from a JSONL line."""
    deep = "[" * 100_000 + "]" * 100_000
    (tmp_path / "deep.json").write_text(deep)
    (tmp_path / "deep.jsonl").write_text('{"prompt": "hi"}\n' + deep + "\n")
    with pytest.raises(SpecDecodeError, match="nests its JSON too deeply"):
        load_prompts(str(tmp_path / "deep.json"))
    with pytest.raises(SpecDecodeError, match="line 2 nests its JSON too deeply"):
        load_prompts(str(tmp_path / "deep.jsonl"))


def test_generate_on_a_model_without_a_tokenizer_says_so_before_measuring(tmp_path, capsys, monkeypatch):
    """Found in review: the cost profile was measured and the drafter calibrated first, then
    "pass token ids instead of text", which the CLI cannot."""
    from conftest import save_tiny_model
    from specdecode import factory

    path = save_tiny_model(tmp_path / "bare", seed=2, num_layers=1)

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was built (profile, calibration) before the refusal")

    monkeypatch.setattr(factory, "build_engine", no_engine)
    code, err = run(capsys, "generate", "hi", "--model", str(path), "--dtype", "fp32", "--backend", "torch")
    assert code == 2 and "has no tokenizer files: `specdecode generate`" in err, err
    for verb in (["bench", "--methods", "none,ngram"], ["analyze", "--methods", "ngram", "--out", str(tmp_path / "a")]):
        code, err = run(capsys, *verb, "--limit", "1", "--model", str(path), "--dtype", "fp32", "--backend", "torch")
        assert code == 2 and f"has no tokenizer files: `specdecode {verb[0]}`" in err, err


def test_a_prompt_limit_keeps_that_many_of_each_category_in_file_order(tmp_path):
    """--limit N: the first N prompts of every category, no more (a mutation audit: N + 1
    passed every test)."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{category} {n}", "category": category}) + "\n"
                            for category, n in [("a", 1), ("b", 1), ("a", 2), ("a", 3), ("b", 2), ("c", 1)]))
    assert [p["prompt"] for p in load_prompts(str(path), limit=1)] == ["a 1", "b 1", "c 1"]
    assert [(p["question_id"], p["prompt"]) for p in load_prompts(str(path), limit=2)] == [
        ("a-1", "a 1"), ("b-1", "b 1"), ("a-2", "a 2"), ("b-2", "b 2"), ("c-1", "c 1")]
    assert len(load_prompts(str(path))) == 6


def test_prompt_records_that_cannot_mean_a_prompt_are_refused(tmp_path):
    """A missing file is named as missing; an Alpaca instruction or input that is not text is
    refused (5 was formatted into "5\\n\\nx"; a list of instructions loaded as a conversation
    and dropped its input), and so is a boolean id (JSON true is no question number). Each
    passed a mutation audit unrefused."""
    with pytest.raises(SpecDecodeError, match="'/nowhere/p.jsonl' not found"):
        load_prompts("/nowhere/p.jsonl")
    path = tmp_path / "prompts.jsonl"
    text_fields = "'instruction' and 'input' must be strings"
    for record, problem in [({"instruction": 5, "input": "x"}, text_fields),
                            ({"instruction": ["a", "b"], "input": "x"}, text_fields),  # the input was dropped
                            ({"instruction": "a", "input": 5}, text_fields),
                            ({"instruction": ["a", "b"]}, text_fields),
                            ({"prompt": "hi", "question_id": True}, "'question_id' must be a string or an integer"),
                            ({"prompt": "hi", "id": False}, "'id' must be a string or an integer")]:
        path.write_text(json.dumps(record) + "\n")
        with pytest.raises(SpecDecodeError, match=f"line 1: {problem}"):
            load_prompts(str(path))


def test_a_json_array_after_blank_space_loads_and_a_blank_system_prompt_is_left_out(tmp_path):
    """A pretty-printed JSON array may start after a blank line or indentation: it is read
    as one array, not as JSONL lines; a chat's system prompt of spaces only is no system
    prompt (a mutation audit: both passed)."""
    path = tmp_path / "chats.json"
    records = [{"id": "c1", "messages": [{"role": "system", "content": "  \n"}, {"role": "user", "content": "Hi"}]},
               {"id": "c2", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Yo"}]}]
    path.write_text("\n  " + json.dumps(records, indent=2))
    loaded = load_prompts(str(path))
    assert [(p["question_id"], p["turns"]) for p in loaded] == [("c1", ["Hi"]), ("c2", ["Yo"])]
    assert "system" not in loaded[0] and loaded[1]["system"] == "Be brief."


@pytest.mark.parametrize("spec, problem", [
    ("bogus@3", "unknown bench method 'bogus'"),
    ("hf@3", "'hf@3': hf takes no k"),
    ("llamacpp@auto", "llamacpp takes no k"),
    ("none@2", "none takes no k"),
    ("ngram@0", "k is an integer, auto or threshold"),
    ("eagle@6x0", "k is an integer, auto or threshold"),
    ("ngram@3x2", "a tree width is for eagle and tree; ngram drafts chains"),
    ("draft@4x2", "a tree width is for eagle and tree; draft drafts chains"),
])
def test_bench_specs_that_name_no_method_or_no_k_it_takes_are_refused(spec, problem):
    """parse_method refuses, before anything loads: an unknown method, a k for plain
    decoding or a peer, a k of 0 (or a width of 0), and a tree width for a chain drafter."""
    from specdecode.bench.runner import parse_method

    with pytest.raises(SpecDecodeError, match=problem):
        parse_method(spec)
    assert parse_method("hf") == ("hf", None) and parse_method("ngram@10") == ("ngram", "10")
    assert parse_method("tree@4x2") == ("tree", "4x2")


def test_int_list_flags_take_spaces_and_a_trailing_comma_and_refuse_other_text():
    """--ngram-sizes and preset values: "4, 3,2," is (4, 3, 2); a part that is no integer
    is refused by the flag's name."""
    from specdecode.config import ConfigError, parse_int_list

    assert parse_int_list("4, 3,2,", "--ngram-sizes") == (4, 3, 2)
    assert parse_int_list(5, "--ngram-sizes") == (5,)
    with pytest.raises(ConfigError, match="--ngram-sizes takes comma-separated integers, got '3,x'"):
        parse_int_list("3,x", "--ngram-sizes")


def test_check_refuses_a_k_of_zero(capsys):
    """check --k 0 means no calibration k at all: refused as -2 is (a mutation audit: a bound
    of `< 0` passed every test)."""
    code, err = run(capsys, "check", "a", "b", "--no-calibration", "--k", "0")
    assert code == 2 and "--k must be >= 1, got 0" in err, err


def test_bounds_at_their_edges_are_taken_or_refused(capsys):
    """The edges of the CLI's bounds (each moved by a mutation audit unnoticed): --temperatures
    inf is refused like nan, an analyze --budget of 0 GiB too; serve --shutdown-timeout 0 (no grace) and --prefill-threads 0 are
    judged by their own bounds (0 seconds is taken: the run goes on to the next check, the
    empty --api-key; 0 threads is refused); a --temperature of GREEDY_BELOW samples, so
    --top-k beside it is taken."""
    from specdecode.config import GREEDY_BELOW

    code, err = run(capsys, "analyze", "--temperatures", "0,inf", "--out", "", "--model", "/nowhere/model")
    assert code == 2 and "--temperatures needs at least one value, each a finite number >= 0" in err, err
    code, err = run(capsys, "analyze", "--budget", "0", "--out", "", "--model", "/nowhere/model")  # --out: next
    assert code == 2 and "--budget must be a finite number > 0 GiB, got 0.0" in err, err
    code, err = run(capsys, "serve", "--shutdown-timeout", "0", "--api-key", "")
    assert code == 2 and "--shutdown-timeout" not in err and "--api-key is empty" in err, err
    code, err = run(capsys, "serve", "--prefill-threads", "0", "--api-key", "")  # the key: refused next
    assert code == 2 and "--prefill-threads must be in 1.." in err, err
    code, err = run(capsys, "generate", "hi", "--temperature", repr(GREEDY_BELOW), "--top-k", "40",
                    "--model", "/nowhere/model")
    assert code == 2 and "shapes sampling" not in err and "/nowhere/model" in err, err


def test_a_bench_plot_whose_place_is_a_directory_is_refused_first(tmp_path, capsys):
    """bench --out r.json draws its plot beside it as r.png: a directory there failed at the
    end of the run (a mutation audit dropped the check unnoticed)."""
    (tmp_path / "r.png").mkdir()
    code, err = run(capsys, "bench", "--methods", "none,ngram", "--out", str(tmp_path / "r.json"),
                    "--model", "/nowhere/model")
    assert code == 2 and "the plot goes beside it as" in err and "which is a directory" in err, err


def test_k_max_beside_a_bench_spec_of_k_auto_or_threshold_is_taken(capsys):
    """ngram@auto and ngram@threshold choose k per step, so --k-max bounds them: taken (the
    run gets to the model path), where beside ngram@3 alone it is refused."""
    for spec in ("ngram@auto", "ngram@threshold", "eagle@autox2"):
        code, err = run(capsys, "bench", "--methods", f"none,{spec}", "--k-max", "5", "--model", "/nowhere/model")
        assert code == 2 and "would be ignored" not in err and "/nowhere/model" in err, (spec, err)


def test_spec_config_takes_each_methods_own_drafter_flag_and_the_threshold_policy():
    """_spec_config: --head goes to eagle, tree and medusa, --store to suffix, --draft to draft;
    a bench spec's k 'threshold' is k auto under the threshold policy, whatever --k-policy says."""
    from specdecode.cli import _spec_config, build_parser

    args = build_parser().parse_args(["bench", "--methods", "none", "--head", "/h", "--store", "/s",
                                      "--draft", "self:1"])
    for method in ("eagle", "tree", "medusa"):
        assert _spec_config(args, method).draft == "/h", method
    assert _spec_config(args, "suffix").draft == "/s" and _spec_config(args, "draft").draft == "self:1"
    threshold = _spec_config(args, "ngram", "threshold")
    assert threshold.k_policy == "threshold" and threshold.k == "auto"
    tree = _spec_config(args, "eagle", "thresholdx3")
    assert tree.k_policy == "threshold" and tree.tree_width == 3
    assert _spec_config(args, "ngram", "auto").k_policy == "cost" and _spec_config(args, "ngram", "2").k == 2


def test_generate_compare_reports_identity_and_speedup_against_plain(capsys, tiny_text_model_dir):
    """generate --compare --json: greedy n-gram drafting decodes plain decoding's tokens, so
    identical_to_plain is true with no divergence, and the speedup is this run's tok/s over
    plain's. Sampled, a --seed given is the one both runs use (not replaced by a random one);
    without one, a seed is drawn and said."""
    common = ["--model", str(tiny_text_model_dir), "--method", "ngram", "--k", "3", "--compare", "--json",
              "--no-chat-template", "--dtype", "fp32", "--max-new-tokens", "8", "--threads", "1"]
    code = main(["generate", "abcabcabcabc", *common])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    record = json.loads(captured.out)
    assert record["identical_to_plain"] is True and "first_divergence" not in record
    assert record["plain"]["new_tokens"] == record["stats"]["new_tokens"] > 0
    assert record["speedup"] == pytest.approx(record["stats"]["tokens_per_s"] / record["plain"]["tokens_per_s"])
    code = main(["generate", "abcabcabcabc", *common, "--temperature", "0.8", "--seed", "5"])
    err = capsys.readouterr().err
    assert code == 0 and "both runs use seed" not in err, err
    code = main(["generate", "abcabcabcabc", *common, "--temperature", "0.8"])
    err = capsys.readouterr().err
    assert code == 0 and "both runs use seed" in err, err


@pytest.mark.parametrize("flags, problem", [
    (["--concurrency", "0,2"], "--concurrency needs positive integers"),
    (["--rounds", "0"], "--rounds must be at least 1, got 0"),
    (["--request-rate", "0"], "--request-rate must be a finite number > 0, got 0.0"),
    (["--modes", "spec,bogus"], "--modes takes a comma list of"),
])
def test_bench_serve_refuses_a_level_round_or_rate_of_zero_or_an_unknown_mode(capsys, flags, problem):
    """Each bound at 0, and a mode it has not (each let through unnoticed by a mutation
    audit). --max-tokens 0 beside it is refused by a later check, so a value let through
    shows as that error instead."""
    code, err = run(capsys, "bench-serve", "--url", "http://127.0.0.1:9", *flags, "--max-tokens", "0")
    assert code == 2 and problem in err, err


def test_train_export_refuses_a_k_below_one_before_loading(tmp_path, capsys):
    """train export --k 0 would write a speculators config proposing no tokens."""
    code, err = run(capsys, "train", "export", "--out", str(tmp_path / "x"), "--k", "0", "--model", "/nowhere/model")
    assert code == 2 and "--k must be >= 1, got 0" in err, err


def test_a_preset_setting_what_the_verb_does_not_take_is_refused(capsys, monkeypatch):
    """A preset's keys become the verb's defaults: one the verb has no flag for is named,
    not set silently on the parser."""
    from specdecode import config

    monkeypatch.setattr(config, "preset", lambda name: {"k_max": 3, "bogus": 1})
    code, err = run(capsys, "generate", "hi", "--preset", "x", "--model", "/nowhere/model")
    assert code == 2 and "preset 'x' sets ['bogus'], which generate does not take" in err, err


def test_analyze_takes_none_beside_a_drafter_and_runs_each_temperature_once(tmp_path, capsys, monkeypatch):
    """--methods none,ngram names a drafter (as the error for --methods none suggests): taken;
    --temperatures 0,0.7,0 runs 0 once. The analysis itself is replaced here: what the CLI
    hands it is checked, and the summary it writes is printed."""
    from specdecode.analysis import analyzer

    seen = {}

    def fake_analyze(args, engine_config, spec_config, params, temperatures, methods, out):
        seen.update(temperatures=temperatures, methods=methods)
        (out / "summary.md").write_text("fake summary")

    monkeypatch.setattr(analyzer, "analyze", fake_analyze)
    code = main(["analyze", "--methods", "none,ngram", "--temperatures", "0,0.7,0", "--out", str(tmp_path / "a"),
                 "--model", "/nowhere/model"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert seen == {"temperatures": [0.0, 0.7], "methods": ["none", "ngram"]}
    assert "fake summary" in captured.out


def test_profile_costs_a_given_draft_and_leaves_out_the_default_only_where_it_cannot_fit(tmp_path, capsys):
    """The default draft self:4 is left out on a target of 4 layers or fewer (4 included: self:4
    needs more); a --draft given is costed on such a target, not left out with it."""
    from conftest import save_tiny_model

    common = ("--backend", "torch", "--dtype", "fp32", "--json")
    code, err = run(capsys, "profile", "--model", str(save_tiny_model(tmp_path / "four", seed=2, num_layers=4,
                                                                        hidden_size=32)), *common)
    assert code == 0 and "not costing the default draft self:4: the target has 4 layers" in err, err
    code = main(["profile", "--model", str(tmp_path / "four"), *common, "--draft", "self:1"])
    captured = capsys.readouterr()
    assert code == 0 and "not costing" not in captured.err, captured.err
    assert any("self:1" in name for name in json.loads(captured.out)["drafters"]), captured.out


def test_generate_prints_the_text_or_one_json_record_with_the_k_it_chose(capsys, tiny_text_model_dir):
    """generate streams the generated text to stdout and its stats line to stderr; with --json,
    stdout is one JSON record of the same text, and under --k auto the k each step chose. A
    mutation audit dropped the stream and k_per_step unnoticed."""
    common = ["generate", "abcabcabcabc", "--model", str(tiny_text_model_dir), "--method", "ngram",
              "--no-chat-template", "--dtype", "fp32", "--weights", "fp32", "--max-new-tokens", "6", "--threads", "1"]
    assert main([*common, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["text"] and record["k"].startswith("auto") and record["stats"]["new_tokens"] == 6
    assert isinstance(record["k_per_step"], list) and record["k_per_step"], record
    assert main(common) == 0
    captured = capsys.readouterr()
    assert captured.out == record["text"] + "\n", captured.out
    assert f"[ngram k={record['k']}] 6 tokens in" in captured.err, captured.err


def test_a_size_of_zero_or_a_json_true_for_one_is_named():
    """Found by a mutation audit: a required size of 0 (a ZeroDivisionError inside, for the
    heads) and a JSON true for an optional size (Python's True is the int 1: a one-position
    context, one KV head of width 1) need their own refusals; no test held either."""
    from specdecode.models.llama import LlamaConfig

    config = {"model_type": "llama", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    assert LlamaConfig.from_hf(config).num_kv_heads == 2
    for field in ("num_attention_heads", "hidden_size"):
        with pytest.raises(SpecDecodeError, match=f"config.json has no positive integer for {field},"):
            LlamaConfig.from_hf({**config, field: 0})
    # a JSON true for a required size too (it read as 1: one layer, or one attention head)
    for field in ("num_hidden_layers", "num_attention_heads", "vocab_size"):
        with pytest.raises(SpecDecodeError, match=f"config.json has no positive integer for {field},"):
            LlamaConfig.from_hf({**config, field: True})
    for field in ("max_position_embeddings", "num_key_value_heads", "head_dim"):
        with pytest.raises(SpecDecodeError, match=f"config.json holds {field} True"):
            LlamaConfig.from_hf({**config, field: True})
