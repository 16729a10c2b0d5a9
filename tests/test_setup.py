"""`strata setup` (hybrid/setup/) on the demo model with the measurement replaced by a small made-up machine:
the config it writes is valid and starts the server, a re-run keeps the values the user set or edited (the
seed report's `layer_split`) and updates its own, --dry-run prints the diff and writes nothing."""
import pytest

import hybrid.setup.cli as setup_cli
from hybrid.cli import build_parser, main
from hybrid.cli_options import config_and_sources
from hybrid.setup.measure import Gpu, Machine
from hybrid.setup.write import merge, scan

CPU_BOX = Machine(cores=2, isa="avx2", cpu_features=("avx2", "f16c"), numa_nodes=1, ram_mib=32000.0,
                  free_ram_mib=30000.0, pinned_limit_mib=None, dram_gbps={1: 12.0, 2: 20.0}, gpu_note="no GPU here")
GPU_BOX = Machine(cores=16, isa="avx512", cpu_features=("avx512bw", "avx2"), numa_nodes=1, ram_mib=64000.0,
                  free_ram_mib=60000.0, pinned_limit_mib=None, dram_gbps={8: 60.0, 16: 80.0},
                  gpus=(Gpu(0, "card", 24000.0, 23000.0, 25.0, 900.0), Gpu(1, "card", 24000.0, 23000.0, 12.0, 900.0)))


@pytest.fixture
def box(monkeypatch, tmp_path):
    """Replace the measurement by a made-up machine; HOME without a config file."""
    monkeypatch.setenv("HOME", str(tmp_path))
    chosen = {"machine": CPU_BOX}
    monkeypatch.setattr(setup_cli, "measure_box", lambda read_mib, weights: chosen["machine"])
    return chosen


def setup(model, path, *flags):
    return main(["setup", "--model", model, "-o", str(path), *flags])


def file_config(path):
    return config_and_sources(build_parser().parse_args(["serve", "--config", str(path)]), {"HOME": "/nowhere"})


def test_setup_writes_a_valid_config_with_a_reason_per_choice(box, demo_path, tmp_path, capsys):
    path = tmp_path / "strata.toml"
    assert setup(demo_path, path) == 0
    out = capsys.readouterr().out
    assert "predicted: decode" in out and "tok/s alone" in out and f"{path} written" in out
    config, sources = file_config(path)
    assert (config.device, config.parallel, config.kv, config.cpu_gbps) == ("cpu", 1, "f32", 20.0)
    kv_line = scan(path.read_text().splitlines())["kv"].line + 1
    assert config.max_context == 4096 and sources["kv"] == f"{path} line {kv_line}"
    entries = scan(path.read_text().splitlines())
    assert all(e.owner == "setup" for e in entries.values())
    assert "(threads: GB/s 1: 12, 2: 20)" in path.read_text()  # the measurement it chose from
    assert "# measured: DRAM read GB/s by threads: 1: 12, 2: 20" in path.read_text().splitlines()
    assert "# measured: no GPU (no GPU here)" in path.read_text().splitlines()


def test_a_rerun_keeps_the_users_values_and_updates_its_own(box, demo_path, tmp_path, capsys):
    """The seed report: re-running setup rewrote a layer_split the user had set. Two GPUs (made up): setup writes
    an explicit split; the user edits it and adds a key of their own; the re-run keeps both and says so, and
    updates a value of its own whose measurement changed."""
    box["machine"] = GPU_BOX
    path = tmp_path / "strata.toml"
    assert setup(demo_path, path) == 0
    first = file_config(path)[0]
    assert first.device == "gpu" and first.layer_split != "auto" and first.parallel == 4
    text = path.read_text().replace(f'\nlayer_split = "{first.layer_split[0]}"', '\nlayer_split = "1"')
    path.write_text(text + "\n# mine\nconversation_cache_mib = 6144\n")
    box["machine"] = Machine(**{**GPU_BOX.__dict__, "dram_gbps": {8: 50.0, 16: 70.0}})
    capsys.readouterr()
    assert main(["setup", "-o", str(path)]) == 0  # the model: the file's
    out = capsys.readouterr().out
    again = file_config(path)[0]
    assert again.layer_split == (1,) and again.conversation_cache_mib == 6144 and again.cpu_gbps == 70.0
    assert f'kept your layer_split = "1" (setup wrote "{first.layer_split[0]}")' in out
    assert "kept your conversation_cache_mib = 6144" in out and "updated cpu_gbps: 80 -> 70" in out
    assert "# mine" in path.read_text()


def test_dry_run_prints_the_diff_and_writes_nothing(box, demo_path, tmp_path, capsys):
    path = tmp_path / "strata.toml"
    assert setup(demo_path, path) == 0
    before = path.read_text()
    box["machine"] = Machine(**{**CPU_BOX.__dict__, "dram_gbps": {1: 12.0, 2: 25.0}})
    capsys.readouterr()
    assert setup(demo_path, path, "--dry-run") == 0
    out = capsys.readouterr().out
    assert "\n-cpu_gbps = 20\n" in out and "\n+cpu_gbps = 25\n" in out and f"--- {path}" in out
    assert "\n-# measured: DRAM read GB/s by threads: 1: 12, 2: 20\n+# measured: DRAM read GB/s by threads: 1: 12, " \
           "2: 25\n" in out
    assert path.read_text() == before
    assert setup(demo_path, tmp_path / "new.toml", "--dry-run") == 0
    assert not (tmp_path / "new.toml").exists()


def test_a_broken_config_is_refused_before_measuring(box, demo_path, tmp_path, capsys):
    path = tmp_path / "strata.toml"
    path.write_text('kv = "f16"\nthreadz = 2\n')
    box["machine"] = None  # measuring would fail
    assert setup(demo_path, path) == 2
    assert capsys.readouterr().err.strip() == f"strata: error: {path} line 2: unknown setting 'threadz' (did you " \
                                              f"mean threads?)"


def test_merge_removes_its_own_value_it_no_longer_sets():
    from hybrid.setup.choose import Choice

    lines, _ = merge([], [Choice("kv_resident", 4096, "why"), Choice("kv", "f16", "why")])
    lines, report = merge(lines, [Choice("kv", "int8", "smaller")])
    assert "kv_resident = 4096" not in lines and 'kv = "int8"' in lines
    assert report == ["removed kv_resident = 4096 (setup wrote it and no longer sets it)",
                      'updated kv: "f16" -> "int8"']


@pytest.mark.slow  # the server's warm-up compiles the demo's kernels when they are not cached
def test_the_config_setup_writes_starts_the_server(box, demo_path, tmp_path):
    from hybrid.cli_options import config_of
    from server.serve import build

    path = tmp_path / "strata.toml"
    assert setup(demo_path, path) == 0
    config = config_of(build_parser().parse_args(["serve", "--config", str(path), "--max-context", "256"]),
                       {"HOME": "/nowhere"})
    _, engine = build(config)
    try:
        assert engine.model.kv_dtype == "f32"
    finally:
        engine.stop()


@pytest.mark.slow
def test_setup_measures_this_box_and_checks_its_prediction(demo_path, tmp_path, capsys, monkeypatch):
    """The real measurement (no GPU on CI: skipped cleanly) and --check's short runs, after a short prompt and
    after one of the predictions' context."""
    monkeypatch.setenv("HOME", str(tmp_path))
    path = tmp_path / "strata.toml"
    assert setup(demo_path, path, "--read-mib", "64", "--check", "--check-tokens", "8", "--predict-context",
                 "200") == 0
    out = capsys.readouterr().out
    assert "at 200 tokens of context" in out
    checks = [line for line in out.splitlines() if line.startswith("check: decode")]
    assert len(checks) == 2 and "at ~204 tokens of context" in checks[1] and "predicted for one slot" in checks[1]
    assert file_config(path)[0].cpu_gbps > 0
    assert "# measured: expert decode kernels GB/s by threads: 1: " in path.read_text()
    other = tmp_path / "other.toml"
    assert setup(demo_path, other, "--read-mib", "16", "--check", "--check-tokens", "4", "--dry-run") == 0
    assert "check: decode" in capsys.readouterr().out and not other.exists()


def test_measurement_skips_the_gpus_cleanly_without_a_runtime():
    from gpu_kernels.runtime import probe
    from hybrid.setup.measure import measure_gpus, thread_counts

    assert thread_counts(1) == [1] and thread_counts(6) == [1, 2, 4, 6] and thread_counts(8) == [1, 2, 4, 8]
    if probe().runtime is None:
        gpus, note, attention = measure_gpus(heads=(8, 2, 64))
        assert gpus == () and note == probe().reason and attention == {}


def synthetic_sizes():
    from placement.budget import ModelSizes

    mib = 1 << 20
    return ModelSizes(num_layers=4, num_experts=8, num_experts_per_tok=2, expert_bytes=(mib,) * 4,
                      layer_dense_bytes=(mib,) * 4, embed_bytes=mib, head_bytes=mib, kv_heads=4, head_dim=128,
                      hidden_size=256, moe_intermediate_size=128, vocab_size=1000)


@pytest.mark.parametrize("context, kv, windowed", [(262144, "f16", False), (524288, "int8", False),
                                                    (1 << 20, "int8", True)])
def test_kv_and_the_resident_window_fit_the_vram(context, kv, windowed):
    """One 24 GB GPU, 2 slots, 16 KiB of f16 KV per token: f16 while it fits a third of the VRAM left (~7.3 GB),
    then int8, then a resident window with the older tokens in pinned RAM."""
    from hybrid.setup.choose import Chooser

    box = Machine(**{**GPU_BOX.__dict__, "gpus": GPU_BOX.gpus[:1]})
    plan = Chooser(box, synthetic_sizes(), context).choose()
    assert (plan.value("kv"), plan.value("max_context")) == (kv, context)
    window = plan.value("kv_resident")
    assert (window is not None) == windowed and (window is None or (window % 1024 == 0 and window < context))
    if windowed:
        assert 2 * window * 4 * 2 * 4 * 130 <= (23000 - 6 - 512) * (1 << 20) / 3  # int8: 130 bytes per head row
    assert plan.value("parallel") == 2 and len(plan.vram_mib) == 1 and plan.vram_mib[0] <= 23000
    assert 0 < plan.decode_tok_s < plan.alone_tok_s and plan.value("layer_split") is None


def test_the_users_values_are_planned_around():
    from hybrid.setup.choose import Chooser

    fixed = {"parallel": 8, "kv": "int8", "layer_split": (1,)}
    plan = Chooser(GPU_BOX, synthetic_sizes(), 65536, fixed=fixed).choose()
    assert [c.name for c in plan.choices] == ["cpu_gbps", "device", "max_context", "gpu_gbps"]
    assert plan.value("max_context") == 65536


def test_setup_plans_the_placement_from_a_profile(box, demo_path, tmp_path, capsys):
    from hybrid.formats import load_model
    from placement.placement import Placement
    from placement.profile import ExpertProfile, model_id

    weights = load_model(demo_path)
    c = weights.config
    profile = ExpertProfile.empty(model_id(weights), c.num_layers, c.num_experts, c.num_experts_per_tok)
    profile.decode[:, :4] = 3
    profile.tokens_decode = 3
    profile.save(tmp_path / "p.npz")
    box["machine"] = GPU_BOX
    path = tmp_path / "strata.toml"
    assert setup(demo_path, path, "--profile", str(tmp_path / "p.npz")) == 0
    config = file_config(path)[0]
    assert config.placement == str(tmp_path / "strata.placement.json")
    assert Placement.load(config.placement).resident_mask(c.num_layers, c.num_experts)[:, :4].all()


def test_a_gpu_is_measured_through_the_runtime_interface(monkeypatch):
    """The GPU measurement on the NumPy stand-in runtime (a copy 'takes' 10 ms): the calls and the arithmetic."""
    from gpu_kernels.numpy_runtime import NumpyRuntime
    from hybrid.setup.measure import _measure_gpu

    rt = NumpyRuntime()
    monkeypatch.setattr(rt, "elapsed", lambda start, stop: 0.01, raising=False)
    gpu = _measure_gpu(rt, 0, copy_mib=4)
    assert (gpu.name, gpu.vram_mib, gpu.free_mib) == ("numpy", 65536, 65536)
    assert (gpu.h2d_gbps, gpu.vram_gbps) == (round(4 * 2**20 / 0.01 / 1e9, 1), round(8 * 2**20 / 0.01 / 1e9, 1))


def test_the_dram_read_kernel_sums_every_value():
    import numpy as np

    from hybrid.setup.measure import _read_kernel

    x = np.random.default_rng(1).random(4096 * 24, dtype=np.float32)
    assert np.isclose(_read_kernel()(x), x.sum(dtype=np.float64), rtol=1e-5)


def test_a_model_of_the_users_own_is_not_replaced(box, demo_path, tmp_path, capsys):
    path = tmp_path / "strata.toml"
    path.write_text('model = "/models/theirs.gguf"\n')
    assert setup(demo_path, path) == 2
    assert capsys.readouterr().err.strip() == (f"strata: error: --model {demo_path}: {path} sets model = "
                                               f"'/models/theirs.gguf' itself; set up for that one, or remove it "
                                               f"from the file")
    assert main(["setup", "-o", str(tmp_path / "none.toml")]) == 2
    assert "strata setup needs --model" in capsys.readouterr().err


@pytest.mark.slow  # strata profile's warm-up and generation
def test_setup_profiles_the_users_prompts_first(box, demo_path, tmp_path, capsys):
    """--prompts without --profile: `strata profile` records them beside the config and the placement is planned
    from that profile."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\nWrite a poem\n")
    box["machine"] = GPU_BOX
    path = tmp_path / "strata.toml"
    assert setup(demo_path, path, "--prompts", str(prompts)) == 0
    assert (tmp_path / "strata.profile.npz").exists()
    config = file_config(path)[0]
    assert config.placement == str(tmp_path / "strata.placement.json")
    assert f"planned from {tmp_path / 'strata.profile.npz'}" in path.read_text()


def test_a_gpu_too_small_for_the_dense_part_leaves_the_model_on_the_cpu():
    from hybrid.setup.choose import Chooser

    tiny = Machine(**{**GPU_BOX.__dict__, "gpus": (Gpu(0, "card", 600.0, 560.0, 25.0, 900.0),)})
    plan = Chooser(tiny, synthetic_sizes(), 65536).choose()
    assert plan.value("device") == "cpu" and plan.value("parallel") == 1 and plan.vram_mib == ()
    assert "the GPUs cannot hold the model's dense part: GPU 0" in next(c.why for c in plan.choices
                                                                        if c.name == "device")
    with pytest.raises(ValueError, match="^setup: the model does not fit these GPUs: GPU 0"):
        Chooser(tiny, synthetic_sizes(), 65536, fixed={"device": "gpu"}).choose()


def test_predictions_grow_slower_with_the_measured_attention_per_key():
    """A GPU box whose one-token attention was timed: each token of context adds its per-key time on every layer
    with KV, so the prediction is for a stated context and falls as the context grows."""
    from hybrid.setup.attention_time import AttentionCost
    from hybrid.setup.choose import Chooser

    cost = AttentionCost((256, 8192), (20e-6, 60e-6), "f16")
    box = Machine(**{**GPU_BOX.__dict__, "gpus": GPU_BOX.gpus[:1], "attention": {"f16": cost, "int8": cost}})
    plan = Chooser(box, synthetic_sizes(), 32768, predict_context=1500).choose()
    assert plan.context == 1500 and plan.key_s == pytest.approx(4 * 40e-6 / 7936)
    assert plan.alone_tok_s == pytest.approx(1 / (plan.step_s + 1500 * plan.key_s))
    assert plan.alone_at(0) > plan.alone_tok_s > plan.alone_at(32768) > 0
    assert plan.busy_at(1500) == pytest.approx(1 / (plan.busy_step_s + 2 * 1500 * plan.key_s))
    unmeasured = Chooser(Machine(**{**box.__dict__, "attention": {}}), synthetic_sizes(), 32768).choose()
    assert unmeasured.key_s == pytest.approx(4 * 2 * 4 * 128 * 2 / 900e9)  # f16 KV bytes at the copy bandwidth


def test_the_attention_timing_fits_a_time_per_key():
    """time_attention launches the one-token attention at each key count (query at the last position, every key
    from 0), once and then GRAPHED times in a captured graph, and keeps the best graph launch's time a launch: a
    stand-in whose launch takes 5 us + 2 ns a key."""
    from gpu_kernels.numpy_runtime import NumpyRuntime
    from hybrid.setup.attention_time import GRAPHED, time_attention

    class Clock(NumpyRuntime):
        def elapsed(self, start, stop):
            return GRAPHED * (5e-6 + 2e-9 * kernels.keys[-1])

    class Kernels:
        stream, keys = None, []

        def paged_attention(self, kv, q, k_pool, v_pool, k_scale, v_scale, table, start, key_lo, scale, out):
            assert q.shape == (1, 8, 64) and k_pool.shape[1:] == (64, 2, 64) and key_lo == 0
            assert (k_scale is None) == (kv != "int8") and k_pool.shape[0] * 64 >= start + 1
            self.keys.append(start + 1 - key_lo)

    kernels = Kernels()
    cost = time_attention(Clock(), kernels, 8, 2, 64, "int8", keys=(256, 1024), repeats=3)
    assert kernels.keys == [256] * (1 + GRAPHED) + [1024] * (1 + GRAPHED)  # the stand-in's capture runs them
    assert cost.per_key_s == pytest.approx(2e-9) and cost.seconds[0] == pytest.approx(5e-6 + 512e-9)
    assert "ns a key" in cost.describe()


def test_an_attention_the_kernels_refuse_is_left_untimed(monkeypatch):
    """Heads the attention kernel refuses (or a runtime error) leave the predictions to the KV's bytes, with a
    warning, instead of ending setup."""
    import hybrid.setup.attention_time as attention_time
    from gpu_kernels.numpy_runtime import NumpyRuntime
    from hybrid.setup.measure import _time_attention

    def refuse(*args):
        raise ValueError("paged_attention: head dim at most 256")

    monkeypatch.setattr(attention_time, "time_attention", refuse)
    assert _time_attention(NumpyRuntime(), (8, 2, 512)) == {}
