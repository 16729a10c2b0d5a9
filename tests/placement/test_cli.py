"""`strata profile`, `profile merge`, `profile show` and `plan` on the tiny GGUF model."""
import json

import numpy as np
import pytest

from hybrid.cli import main
from placement.placement import Placement
from placement.profile import ExpertProfile


@pytest.fixture(scope="module")
def tiny_model(gguf_models):
    return gguf_models("small", "Q8_0")[0]


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('[{"role": "user", "content": "hello"}]\n{"prompt": "one two three"}\n')
    return path


def test_profile_merge_show_plan(tmp_path, tiny_model, prompts, capsys):
    out = tmp_path / "p.npz"
    assert main(["profile", "--model", tiny_model, "--prompts", str(prompts), "--max-tokens", "3",
                 "-o", str(out)]) == 0
    profile = ExpertProfile.load(out)
    assert (profile.num_layers, profile.num_experts) == (3, 8)
    assert profile.tokens_decode == 2 * 2 and profile.tokens_prefill > 0  # 3 tokens: 2 decode steps per prompt
    assert (profile.decode.sum(axis=1) == 4 * 2).all()
    assert profile.part_tokens[:, 1].tolist() == [2, 2]  # one part per prompt, for the planner's check
    merged = tmp_path / "m.npz"
    assert main(["profile", "merge", str(out), str(out), "-o", str(merged)]) == 0
    assert ExpertProfile.load(merged).tokens_decode == 8
    assert len(ExpertProfile.load(merged).part_tokens) == 4
    capsys.readouterr()
    assert main(["profile", "show", str(merged), "--png", str(tmp_path / "h.png")]) == 0
    shown = capsys.readouterr().out
    assert "8 decode" in shown and "top 10% of experts" in shown
    placement_path = tmp_path / "placement.json"
    assert main(["plan", "--model", tiny_model, "--profile", str(merged), "--gpu-mib", "200", "--parallel", "2",
                 "--max-context", "256", "--vram-reserve-mib", "0", "-o", str(placement_path)]) == 0
    printed = capsys.readouterr().out
    assert "global top-k" in printed and "uniform" in printed and "checked on 4 folds" in printed
    placement = Placement.load(placement_path)
    assert placement.resident_mask(3, 8).all()  # the tiny model fits whole
    assert json.loads(placement_path.read_text())["settings"]["parallel"] == 2


def test_plan_refuses_a_too_small_gpu(tmp_path, tiny_model, capsys):
    profile = ExpertProfile.empty("x", 3, 8, 2)
    profile.decode[:] = 1
    profile.tokens_decode = 4
    profile.save(tmp_path / "p.npz")
    assert main(["plan", "--model", tiny_model, "--profile", str(tmp_path / "p.npz"), "--gpu-mib", "10",
                 "-o", str(tmp_path / "pl.json")]) == 2
    assert "GPU 0: 10 MiB cannot hold layers 0-2: dense weights" in capsys.readouterr().err


def test_plan_refuses_another_models_profile(tmp_path, tiny_model, capsys):
    ExpertProfile.empty("x", 4, 8, 2).save(tmp_path / "p.npz")
    assert main(["plan", "--model", tiny_model, "--profile", str(tmp_path / "p.npz"), "--gpu-mib", "200",
                 "-o", str(tmp_path / "pl.json")]) == 2
    assert "(4 layers x 8 experts) does not fit the model" in capsys.readouterr().err


def test_profile_refuses_a_malformed_prompts_file(tmp_path, tiny_model, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": \n')
    assert main(["profile", "--model", tiny_model, "--prompts", str(bad), "-o", str(tmp_path / "p.npz")]) == 2
    assert "bad.jsonl line 2: not valid JSON" in capsys.readouterr().err
    assert not (tmp_path / "p.npz").exists()


def test_show_refuses_a_file_that_is_no_profile_in_our_words(tmp_path, tiny_model, capsys):
    assert main(["profile", "show", tiny_model]) == 2
    assert capsys.readouterr().err.strip() == (f"strata: error: {tiny_model}: not a Strata expert profile (not an "
                                               f".npz archive; `strata profile -o P.npz` writes one)")
    objects = tmp_path / "objects.npz"
    np.savez(objects, header=np.array([{"format": "pickled"}], dtype=object))
    assert main(["profile", "merge", str(objects), "-o", str(tmp_path / "m.npz")]) == 2
    err = capsys.readouterr().err
    assert "objects.npz: not a Strata expert profile (an .npz archive whose arrays are damaged or hold Python " \
           "objects)" in err
    assert "allow_pickle" not in err


def test_plan_refuses_a_context_beyond_the_models(tmp_path, tiny_model, capsys):
    profile = tmp_path / "p.npz"
    ExpertProfile.empty("x", 3, 8, 2).save(profile)
    assert main(["plan", "--model", tiny_model, "--profile", str(profile), "--gpu-mib", "200", "--max-context",
                 "4096", "-o", str(tmp_path / "pl.json")]) == 2
    assert capsys.readouterr().err.strip() == (f"strata: error: --max-context 4096: {tiny_model} holds a context "
                                               f"of 1 to 1024 tokens (from its metadata)")


def test_plan_output_says_whether_the_check_kept_the_plan():
    from placement.cli import format_check

    assert format_check({"folds": 0, "keep": True, "why": "fewer than two parts: nothing to hold out"}).startswith(
        "plan not checked against the global top-k")
    line = format_check({"folds": 10, "gain_ms": -0.01, "gain_se_ms": 0.004, "hit_points": -0.5, "keep": False})
    assert "checked on 10 folds" in line and "-0.50 hit-rate points" in line and line.endswith("by the counts")
