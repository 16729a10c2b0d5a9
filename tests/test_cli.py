"""`strata` arguments are refused before anything loads, in one line that names the flag; `strata --version`."""
import logging
import socket
from importlib.metadata import version

import pytest

import hybrid.llm
from hybrid.cli import build_parser, main

BAD_ARGUMENTS = [  # (argv, the one line's end)
    (["serve", "--port", "99999"], "argument --port: must be in 1..65535, got 99999"),
    (["serve", "--port", "0"], "argument --port: must be in 1..65535, got 0"),
    (["serve", "--parallel", "0"], "argument --parallel: must be >= 1, got 0"),
    (["serve", "--max-queue", "0"], "argument --max-queue: must be >= 1, got 0"),
    (["serve", "--decode-share", "0"], "argument --decode-share: must be in (0, 1], got 0"),
    (["serve", "--decode-share", "1.5"], "argument --decode-share: must be in (0, 1], got 1.5"),
    (["serve", "--max-context", "0"], "argument --max-context: must be >= 1, got 0"),
    (["serve", "--threads", "0"], "argument --threads: must be >= 1, got 0"),
    (["serve", "--max-body-mib", "0"], "argument --max-body-mib: must be > 0, got 0"),
    (["serve", "--max-connections", "0"], "argument --max-connections: must be >= 1, got 0"),
    (["serve", "--conversation-cache-mib", "-1"], "argument --conversation-cache-mib: must be >= 0, got -1"),
    (["generate", "--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    (["generate", "--max-tokens", "0"], "argument -n/--max-tokens: must be >= 1, got 0"),
    (["generate", "--temperature", "nan"], "argument --temperature: expected a finite number, got 'nan'"),
    (["generate", "--top-p", "0"], "argument --top-p: must be in (0, 1], got 0"),
    (["generate", "--max-context", "ten"], "argument --max-context: expected an integer, got 'ten'"),
    (["generate", "--placement", "nowhere.json"], "argument --placement: nowhere.json: no such file"),
    (["generate", "--prompt-ids", "1,x"], "argument --prompt-ids: expected comma-separated integers, got '1,x'"),
    (["generate", "--prompt-ids", "1,-2"], "argument --prompt-ids: expected token ids >= 0, got '1,-2'"),
    (["profile", "--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    (["profile", "-o", "no/such/folder/p.npz"], "argument -o/--output: no/such/folder/p.npz: no folder no/such/folder "
                                                "to write it in"),
    (["serve", "--profile-out", "/"], "argument --profile-out: /: a folder, not a file name"),
    (["profile", "--max-tokens", "0"], "argument --max-tokens: must be >= 1, got 0"),
    (["profile", "show", "nowhere.npz"], "argument profile: nowhere.npz: no such file"),
    (["profile", "merge", "nowhere.npz", "-o", "out.npz"], "argument inputs: nowhere.npz: no such file"),
    (["plan", "--model", "m.gguf", "--profile", __file__, "--gpu-mib", "24000,x", "-o", "p.json"],
     "argument --gpu-mib: expected MiB per GPU, comma-separated (e.g. 24000,24000), got '24000,x'"),
    (["plan", "--model", "m.gguf", "--profile", __file__, "--gpu-mib", "0", "-o", "p.json"],
     "argument --gpu-mib: every GPU needs a positive size, got '0'"),
    (["plan", "--model", "m.gguf", "--profile", __file__, "--gpu-mib", "1", "--parallel", "0", "-o", "p.json"],
     "argument --parallel: must be >= 1, got 0"),
]


@pytest.mark.parametrize("argv,expected", BAD_ARGUMENTS, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_a_bad_argument_is_one_line_naming_the_flag(argv, expected, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert len(err.splitlines()) == 1, err
    assert expected in err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"strata {version('strata')}"


def no_backends(*args, **kwargs):
    raise AssertionError("backends were built before the arguments were checked")


def test_max_context_beyond_the_model_fails_before_the_backends(gguf_models, monkeypatch, capsys):
    path = gguf_models("small", "Q8_0")[0]
    monkeypatch.setattr(hybrid.llm, "select_backends", no_backends)
    assert main(["generate", "--model", path, "--max-context", "32768", "-n", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"strata: error: --max-context 32768: {path} holds a context of 1 to 1024 tokens "
                       f"(from its metadata)")


def test_max_context_beyond_the_demo_models_fails_before_it_is_built(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))  # an empty cache: the demo model would be built
    assert main(["generate", "--max-context", "32768"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "strata: error: --max-context 32768: the demo model holds a context of 1 to 4096 tokens (from its metadata)")
    assert not list(tmp_path.iterdir())


def test_placement_with_device_cpu_fails_before_the_model_loads(tmp_path, capsys):
    placement = tmp_path / "placement.json"
    placement.write_text("{}")
    missing_model = str(tmp_path / "missing.gguf")  # never reached
    assert main(["generate", "--model", missing_model, "--device", "cpu", "--placement", str(placement)]) == 2
    assert capsys.readouterr().err.strip() == (
        "strata: error: --placement: set up the GPU's expert cache, so they do nothing with --device cpu")


def test_expert_cache_mib_with_device_cpu_is_refused(capsys):
    assert main(["generate", "--device", "cpu", "--expert-cache-mib", "100", "--expert-cache", "dynamic"]) == 2
    assert capsys.readouterr().err.strip() == ("strata: error: --expert-cache dynamic, --expert-cache-mib: set up the "
                                               "GPU's expert cache, so they do nothing with --device cpu")


def test_profile_without_a_gpu_warns_and_predicts_nothing(gguf_models, tmp_path, monkeypatch, caplog):
    import gpu_kernels.runtime
    from placement.profile import ExpertProfile

    monkeypatch.setattr(gpu_kernels.runtime, "probe", lambda: gpu_kernels.runtime.Probe(None, "no GPU here"))
    profile = tmp_path / "p.npz"
    ExpertProfile.empty("x", 3, 8, 2).save(profile)
    with caplog.at_level(logging.INFO), hybrid.llm.LLM(gguf_models("small", "Q8_0")[0], device="auto",
                                                       profile=str(profile), max_context=64) as llm:
        assert llm.device == "cpu"
    assert "--profile: no usable GPU (no GPU here), so they do nothing: every expert runs on the CPU" in caplog.text
    assert "predicted" not in caplog.text and "expert cache:" not in caplog.text


def capture_build(monkeypatch):
    import server.serve

    seen = {}

    def build_from_args(args, config):
        seen.update(args=args, config=config)
        return "the app", None

    monkeypatch.setattr(server.serve, "build_from_args", build_from_args)
    return seen


def test_get_app_keeps_the_serve_defaults_and_warns_without_a_key(monkeypatch, caplog):
    """get_app is the environment layer of the server: STRATA_* variables are its settings."""
    from server.app import get_app

    seen = capture_build(monkeypatch)
    monkeypatch.setenv("STRATA_PARALLEL", "3")
    monkeypatch.delenv("STRATA_API_KEY", raising=False)
    with caplog.at_level(logging.WARNING):
        assert get_app() == "the app"
    serve_defaults = vars(build_parser().parse_args(["serve"]))
    assert vars(seen["args"]) == {k: v for k, v in serve_defaults.items() if k not in ("verbose", "command", "func")}
    assert seen["config"].parallel == 3 and seen["config"].api_key is None and seen["config"].device == "auto"
    assert "no STRATA_API_KEY" in caplog.text and "--listen 127.0.0.1:8080" in caplog.text


def test_get_app_refuses_a_bad_setting_in_one_line(monkeypatch):
    from server.app import get_app

    capture_build(monkeypatch)
    monkeypatch.setenv("STRATA_PARALLEL", "0")
    with pytest.raises(SystemExit, match=r"^strata: error: STRATA_PARALLEL: must be >= 1, got 0$"):
        get_app()


def test_a_bad_decode_share_is_named_before_the_model_loads(tmp_path):
    from hybrid.config import EngineConfig

    with pytest.raises(ValueError, match=r"^decode_share: must be in \(0, 1\], got 2$"):
        EngineConfig(model=str(tmp_path / "never-loaded.gguf"), decode_share=2)
    with pytest.raises(ValueError, match=r"^STRATA_BATCH_DECODE_SHARE: must be in \(0, 1\], got 2$"):
        EngineConfig.resolve(environ={"STRATA_BATCH_DECODE_SHARE": "2"})


def test_a_folder_the_system_refuses_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    spill = str(blocker / "spill")  # under a file: no folder can be made there
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["serve", "--port", str(port), "--conversation-cache-dir", spill, "--model", "never-loaded.gguf"]) == 2
    assert capsys.readouterr().err.strip() == f"strata: error: {spill}: Not a directory"


@pytest.mark.parametrize("flags,limit", [([], 100), (["--parallel", "8"], 8 + 16 * 8),
                                         (["--parallel", "8", "--max-queue", "8"], 100),
                                         (["--max-connections", "500"], 500)])
def test_the_connection_limit_admits_every_queued_request(flags, limit):
    from hybrid.cli_options import config_of
    from server.serve import connection_limit

    args = build_parser().parse_args(["serve", *flags])
    assert connection_limit(config_of(args, environ={}), args.max_connections) == limit


def test_a_connection_limit_below_the_queue_warns(caplog):
    from server.serve import connection_limit

    from hybrid.config import EngineConfig

    with caplog.at_level(logging.WARNING):
        assert connection_limit(EngineConfig(), 10) == 10
    assert "--max-connections 10 is below the 17 requests that --parallel and --max-queue admit" in caplog.text
