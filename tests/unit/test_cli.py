"""``python -m app``'s command line: --help groups, served names, refused --model values, the banner."""

from __future__ import annotations

import re

import pytest

from app.banner import binary_size, display_host, format_banner
from app.cli import (
    build_engine_args,
    build_frontend_config,
    make_parser,
    model_dir_error,
    parse_args,
    served_model_names,
)
from app.scale_out import scale_out_error
from core.models.default_model import DEFAULT_MODEL_DIR
from core.protocol import HandshakeReady
from tests.support.servers import run_app

GROUPS = {
    "model": {"--model", "--served-model-name", "--tokenizer", "--chat-template", "--dtype", "--max-model-len"},
    "scheduler": {
        "--max-num-seqs", "--max-num-batched-tokens", "--scheduling-policy", "--async-scheduling", "--speculative-config",
    },
    "pooling": {"--runner", "--convert", "--override-pooler-config"},
    "cache": {
        "--block-size", "--kv-cache-dtype", "--kv-cache-memory", "--enable-prefix-caching", "--num-gpu-blocks-override",
    },
    "server": {"--host", "--port", "--api-key", "--disable-frontend-ui", "--log-level"},
    "transport": {"--transport"},
    "scale-out": {
        "--data-parallel-size", "--api-server-count", "--restart-dead-engines", "--data-parallel-backend",
        "--headless", "--data-parallel-address", "--data-parallel-rpc-port", "--data-parallel-start-rank",
        "--data-parallel-size-local", "--engine-threads", "--ray-engine-resources",
        "--data-parallel-prefix-affinity",
    },
}


def test_help_groups_every_flag_and_explains_it() -> None:
    parser = make_parser()
    groups = {g.title: g for g in parser._action_groups}
    for title, flags in GROUPS.items():
        assert flags <= {s for a in groups[title]._group_actions for s in a.option_strings}, title
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help text"
    text = parser.format_help()
    assert all(f"\n{title}:\n" in text for title in GROUPS)


@pytest.mark.parametrize("model", ["meta-llama/Llama-3.2-1B", "Qwen/Qwen3-0.6B"])
def test_hub_id_is_refused_with_exit_status_2(model: str) -> None:
    result = run_app("--model", model)
    assert result.returncode == 2
    assert "never downloads" in result.stderr
    assert f"hf download {model} --local-dir DIR" in result.stderr and "--model DIR" in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_or_unusable_model_paths_exit_2(tmp_path) -> None:
    result = run_app("--model", str(tmp_path / "absent"))
    assert result.returncode == 2 and "no such directory" in result.stderr
    assert "never downloads" not in result.stderr  # an absolute path is no hub id
    assert "not a Hugging Face model directory" in model_dir_error(str(tmp_path))  # no config.json
    (tmp_path / "config.json").write_text("{}")
    assert model_dir_error(str(tmp_path)) is None
    assert "not a directory" in model_dir_error(str(tmp_path / "config.json"))
    assert "never downloads" not in model_dir_error("./org/name")


def test_an_engine_process_that_cannot_start_early_is_no_error_of_its_own(tmp_path, monkeypatch, capsys) -> None:
    """``python -m app`` starts its engine before it reads its arguments (EarlyEngine); where that
    fails (no process or pipe to spare), the arguments are still read and judged as usual."""
    import app.__main__ as entry

    def no_process() -> None:
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(entry, "EarlyEngine", no_process)
    with pytest.raises(SystemExit) as exit_:
        entry.main(["--model", str(tmp_path / "absent")])
    assert exit_.value.code == 2 and "no such directory" in capsys.readouterr().err


@pytest.mark.parametrize("scale_out", [[], ["--api-server-count", "2"]], ids=["one frontend", "API servers"])
def test_an_engine_that_refuses_its_config_exits_1_with_the_reason_and_no_traceback(scale_out: list[str]) -> None:
    """The KV cache's size is known only once the engine has loaded the model; a cache that cannot
    hold one request of max_model_len stops the server with its reason, as an argument error would."""
    result = run_app(
        "--port", "0", "--max-model-len", "64", "--block-size", "16", "--num-gpu-blocks-override", "4", *scale_out
    )
    assert result.returncode == 1, result.stderr
    said = r"python -m app: error: " if not scale_out else r"\[api \d\]: "  # the first to exit said it
    assert re.search(said + "EngineCore failed to start: 4 KV cache blocks", result.stderr)
    assert "lower --max-model-len" in result.stderr
    assert "Traceback" not in result.stderr


def test_default_model_and_served_names() -> None:
    args = parse_args([])
    config = build_engine_args(args)
    assert config.model == str(DEFAULT_MODEL_DIR) and config.served_model_name == "stories260K"
    assert served_model_names(args) == ["stories260K", "ringllm-default"]
    args = parse_args(["--model", "/models/m", "--served-model-name", "main", "alias"])
    assert build_engine_args(args).served_model_name == "main"
    assert served_model_names(args) == ["main", "alias"]
    assert served_model_names(parse_args(["--model", "/models/m"])) == ["/models/m"]
    assert parse_args(["--disable-frontend-ui"]).disable_frontend_ui
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--served-model-name"])  # nargs="+": at least one name


def test_banner() -> None:
    ready = HandshakeReady("READY", num_gpu_blocks=100, max_model_len=512, block_size=16, dtype="float32",
                           kv_cache_dtype="float16", device="cpu", kv_cache_bytes=100 * 16 * 2048)
    text = format_banner(
        model="/m", served_names=["stories260K", "ringllm-default"], ready=ready, transport="shm",
        host="0.0.0.0", port=8000, routes={"/", "/v1/models"},
    )
    assert text.splitlines()[0] == "ringllm is ready" and len(text.splitlines()) == 7
    assert "100 blocks x 16 tokens = 1,600 tokens of float16, 3.1 MiB;" in text and "float32 on cpu" in text
    assert "chat page  http://127.0.0.1:8000/" in text and "API        http://127.0.0.1:8000/v1" in text
    assert "metrics" not in text
    bare = format_banner(
        model="/m", served_names=["m"], ready=ready, transport="zmq", host="::", port=1,
        routes={"/metrics"},
    )
    assert "chat page" not in bare and "metrics    http://[::1]:1/metrics" in bare and "also answers" not in bare
    assert display_host("localhost") == "localhost" and display_host("::1") == "[::1]"
    assert [binary_size(n) for n in (1023, 1536, 3 << 29, 5 << 40)] == ["1,023 bytes", "1.5 KiB", "1.5 GiB", "5.0 TiB"]


def test_parse_size_errors_are_argparse_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        make_parser().parse_args(["--kv-cache-memory", "lots"])
    assert exited.value.code == 2
    assert "--kv-cache-memory: not a size in bytes: 'lots'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--api-server-count", "2", "--transport", "zmq"], "needs the shm transport"),
        (["--api-server-count", "2", "--restart-dead-engines"], "one API server process only"),
        (["--api-server-count", "2", "--data-parallel-backend", "ray"], "every engine on this host"),
        (["--ray-engine-resources", '[{"a": 1}]'], "needs --data-parallel-backend ray"),
        (["-dp", "2", "-dpl", "3"], "cannot exceed"),
        (["-dp", "2", "--headless"], "--headless needs --data-parallel-address"),
        (["-dp", "2", "-dpl", "1"], "need --data-parallel-address"),
        (["-dp", "2", "--headless", "-dpa", "h", "-dpr", "2"], "exceed --data-parallel-size"),
    ],
)
def test_scale_out_flag_combinations_that_cannot_work_are_refused(flags: list[str], needle: str) -> None:
    problem = _scale_out_error(flags)
    assert problem is not None and needle in problem


def _scale_out_error(flags: list[str]) -> str | None:
    args = parse_args(flags)
    return scale_out_error(build_frontend_config(args).scale_out, build_engine_args(args))


def test_scale_out_errors_exit_2_before_anything_starts() -> None:
    result = run_app("--api-server-count", "2", "--transport", "zmq")
    assert result.returncode == 2 and "needs the shm transport" in result.stderr
    assert _scale_out_error(["-dp", "2", "--api-server-count", "2"]) is None
    assert _scale_out_error([]) is None


def test_the_frontend_config_holds_every_frontend_flag(tmp_path) -> None:
    """Nothing below the command line reads the argparse Namespace: what the frontend
    needs is in its FrontendConfig, the rest in EngineArgs."""
    from app.frontend_config import FrontendConfig, ScaleOutConfig

    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages }}")
    args = parse_args([
        "--port", "9001", "--api-key", "k", "--chat-template", str(template), "--disable-frontend-ui",
        "--max-num-waiting", "3", "--shutdown-timeout", "2", "--enable-sleep-mode", "-dp", "2",
        "--api-server-count", "2", "--data-parallel-prefix-affinity", "--served-model-name", "a", "b",
    ])
    frontend = build_frontend_config(args)
    assert isinstance(frontend, FrontendConfig) and frontend.served_model_names == ("a", "b")
    assert (frontend.port, frontend.api_key, frontend.chat_template, frontend.enable_ui) == (9001, "k", "{{ messages }}", False)
    assert (frontend.max_num_waiting, frontend.shutdown_timeout, frontend.enable_sleep_mode) == (3, 2.0, True)
    assert frontend.scale_out == ScaleOutConfig(api_server_count=2, prefix_affinity=True)
    engine = build_engine_args(args)
    assert (engine.data_parallel_size, engine.enable_sleep_mode, engine.served_model_name) == (2, True, "a")


def test_the_json_whitespace_bound_flag() -> None:
    from core.config import DEFAULT_JSON_MAX_WHITESPACE

    bound = lambda *flag: build_engine_args(parse_args(list(flag))).structured_outputs_max_whitespace  # noqa: E731
    assert bound() == DEFAULT_JSON_MAX_WHITESPACE
    assert bound("--structured-outputs-max-whitespace", "4") == 4
    assert bound("--structured-outputs-max-whitespace", "none") is None  # unbounded, as vLLM has it
    for bad in ("0", "-1", "many"):
        result = run_app("--structured-outputs-max-whitespace", bad)
        assert result.returncode == 2 and "not a count of characters (at least 1) or 'none'" in result.stderr


def test_the_kv_cache_dtype_flag() -> None:
    assert build_engine_args(parse_args([])).kv_cache_dtype == "auto"
    assert build_engine_args(parse_args(["--kv-cache-dtype", "float16"])).kv_cache_dtype == "float16"
    result = run_app("--kv-cache-dtype", "int8")
    assert result.returncode == 2 and "--kv-cache-dtype" in result.stderr


def test_every_engine_knob_is_an_option_built_from_its_field() -> None:
    """Each user-facing EngineArgs field is written once (core/config.py's Knob): its option's
    name, default and help come from the field; fields without a Knob are the program's own."""
    import msgspec

    from core.config import EngineArgs, engine_knobs

    knobs = engine_knobs()
    assert {f.name for f in msgspec.structs.fields(EngineArgs)} - {f.name for f, _ in knobs} == {
        "engine_drain_timeout", "data_parallel_rank",
    }
    parser = make_parser()
    actions = {a.dest: a for a in parser._actions}
    titles = {a.dest: g.title for g in parser._action_groups for a in g._group_actions}
    text = "".join(parser.format_help().split())  # argparse wraps lines, even at hyphens
    for field, knob in knobs:
        action = actions[field.name]
        assert action.help.startswith(knob.help) and titles[field.name] == knob.group, field.name
        assert "".join(knob.help.split()) in text, field.name
        if not field.required:
            default = field.default_factory() if field.default is msgspec.NODEFAULT else field.default
            assert action.default == default, field.name
            if isinstance(default, (int, float, str)) and not isinstance(default, bool):
                assert action.help.endswith("(default: %(default)s)"), field.name  # not restated
    # The parsed options reach their fields: each option's value, whatever it is, lands in its field.
    args = parse_args([])
    for field, _ in knobs:
        setattr(args, field.name, [field.name] if field.name == "served_model_name" else field.name)
    built = build_engine_args(args)
    assert all(getattr(built, f.name) == f.name for f, _ in knobs)
    # No option left unset: EngineArgs' defaults, the embedded model aside.
    assert build_engine_args(parse_args([])) == EngineArgs(model=str(DEFAULT_MODEL_DIR), served_model_name="stories260K")


@pytest.mark.parametrize(
    ("flags", "field", "value"),
    [
        (["--no-enable-prefix-caching"], "enable_prefix_caching", False),
        (["--enable-prefix-caching"], "enable_prefix_caching", True),
        (["--no-enable-chunked-prefill"], "enable_chunked_prefill", False),
        (["--disable-log-stats"], "log_stats", False),
        (["--enforce-eager"], "enforce_eager", True),
        (["--enable-lora"], "enable_lora", True),
        (["-dp", "3"], "data_parallel_size", 3),
        (["-dpl", "2"], "data_parallel_size_local", 2),
        (["--dtype", "bf16"], "dtype", "bfloat16"),
        (["--kv-cache-memory", "1GiB"], "kv_cache_memory", 2**30),
        (["--engine-cpu", "off"], "engine_cpu", "off"),
        (["--lora-modules", "a=/x", "--lora-modules", '{"name": "b", "path": "/y"}'], "lora_modules", ["a", "b"]),
    ],
)
def test_the_flags_users_type_keep_their_spelling(flags: list[str], field: str, value: object) -> None:
    got = getattr(build_engine_args(parse_args(flags)), field)
    assert ([m.name for m in got] if field == "lora_modules" else got) == value


def test_engine_knob_errors_are_argparse_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for flags, message in [
        (["--max-loras", "0"], "argument --max-loras: must be at least 1, got 0"),
        (["-dp", "0"], "argument --data-parallel-size/-dp: must be at least 1, got 0"),
        (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        (["--lora-modules", "x"], "invalid LoRA module 'x': expected name=path or JSON"),
        (["--speculative-config", "{}"], "argument --speculative-config: invalid speculative config '{}'"),
        (["--override-pooler-config", "[1]"], "argument --override-pooler-config: invalid pooler config '[1]'"),
        (["--engine-cpu", "x"], "expected auto, off or a core number, got 'x'"),
    ]:
        with pytest.raises(SystemExit) as exited:
            parse_args(flags)
        assert exited.value.code == 2 and message in capsys.readouterr().err, flags


def test_each_concern_checks_its_own_section_and_every_knob_reaches_the_engine_config() -> None:
    """EngineConfig is the model as served plus a section per concern; each section refuses
    its own bad settings as it is made (before any checkpoint is read), and every EngineArgs
    field lands somewhere in EngineConfig (or is consumed by resolve, said here)."""
    import msgspec

    from core.config import (
        CacheConfig, EngineArgs, EngineConfig, LoRAConfig, LoRAModule, ParallelConfig, SchedulerConfig,
        StructuredOutputsConfig,
    )

    cache = dict(block_size=16, kv_cache_dtype="auto", num_gpu_blocks_override=None, kv_cache_memory=None,
                 gpu_memory_utilization=0.9, enable_prefix_caching=True)
    refused = [
        (lambda: CacheConfig(**{**cache, "kv_cache_dtype": "int4"}), "kv_cache_dtype must be one of"),
        (lambda: CacheConfig(**{**cache, "gpu_memory_utilization": 1.5}), "gpu_memory_utilization must be in"),
        (lambda: SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=True,
                                 scheduling_policy="lifo", async_scheduling=False), "scheduling_policy"),
        (lambda: ParallelConfig(data_parallel_size=2, data_parallel_rank=2, data_parallel_size_local=None,
                                engine_threads=None), "data_parallel_rank 2 is not in 0..1"),
        (lambda: LoRAConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=1, lora_modules=[]), "max_cpu_loras"),
        (lambda: LoRAConfig(max_loras=1, max_lora_rank=8, max_cpu_loras=1,
                            lora_modules=[LoRAModule(name="a", path="/x"), LoRAModule(name="a", path="/y")]),
         "used twice"),
        (lambda: StructuredOutputsConfig(backend="xgrammar", max_whitespace=0), "max_whitespace must be >= 1"),
        # Through resolve: the section refuses before the (missing) checkpoint is looked at.
        (lambda: EngineArgs(model="/nonexistent", block_size=0).resolve(), "block_size must be >= 1"),
    ]
    for make, message in refused:
        with pytest.raises(ValueError, match=message):
            make()

    sections = {f.name: f.type for f in msgspec.structs.fields(EngineConfig) if f.name.endswith("_config")}
    landed = {f.name for f in msgspec.structs.fields(EngineConfig)}
    for section in (CacheConfig, SchedulerConfig, ParallelConfig, LoRAConfig):
        landed |= {f.name for f in msgspec.structs.fields(section)}
    landed |= {"structured_outputs_" + f.name for f in msgspec.structs.fields(StructuredOutputsConfig)}
    consumed = {"enable_lora": "lora_config is None when off", "runner": "pooler_config", "convert": "pooler_config",
                "override_pooler_config": "pooler_config"}
    assert {"cache_config", "scheduler_config", "parallel_config", "lora_config"} <= set(sections)
    assert {f.name for f in msgspec.structs.fields(EngineArgs)} - landed == set(consumed)


def test_the_step_budget_defaults_to_the_device_and_holds_a_prompt_without_chunked_prefill() -> None:
    """512 tokens a step on a CPU (llama.cpp's micro-batch: a chunk's activations are held per
    token), 2048 on a GPU; a given budget is kept. Without chunked prefill a prompt goes in one
    step: the default grows to the context, a given budget smaller than it is refused."""
    import msgspec

    from core.config import CPU_STEP_BUDGET, GPU_STEP_BUDGET, EngineArgs

    def budget(**kw: object) -> int:
        args = EngineArgs(model=str(DEFAULT_MODEL_DIR), max_model_len=256, **kw)
        return args.resolve().scheduler_config.max_num_batched_tokens

    assert (CPU_STEP_BUDGET, GPU_STEP_BUDGET) == (512, 2048)
    assert budget(device="cpu") == 512 and budget(device="cuda") == 2048
    assert budget(device="cpu", max_num_batched_tokens=96) == 96
    assert budget(device="cpu", enable_chunked_prefill=False) == 512
    long = EngineArgs(model=str(DEFAULT_MODEL_DIR), device="cpu", enable_chunked_prefill=False, max_model_len=1024)
    assert long.resolve().scheduler_config.max_num_batched_tokens == 1024
    with pytest.raises(ValueError, match="must be >= max_model_len without chunked prefill"):
        msgspec.structs.replace(long, max_num_batched_tokens=600).resolve()


def test_a_context_past_the_trained_positions_is_served_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """As llama.cpp does with a -c past n_ctx_train: rotary positions go on, the quality may not."""
    from core.config import EngineArgs

    with caplog.at_level("WARNING", logger="ringllm"):
        assert EngineArgs(model=str(DEFAULT_MODEL_DIR), max_model_len=512).resolve().max_model_len == 512
        assert not caplog.records
        assert EngineArgs(model=str(DEFAULT_MODEL_DIR), max_model_len=1024).resolve().max_model_len == 1024
    assert [r.getMessage() for r in caplog.records] == [
        "max_model_len 1024 is past the 512 positions the model was trained on: it runs (rotary positions "
        "have no end), but its outputs past them may be poor"
    ]
