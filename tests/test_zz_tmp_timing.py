import time, pytest
from hybrid import LLM
PROMPT = [3, 17, 42, 5, 99, 23, 64, 7, 11, 250, 31, 8, 77, 120, 19, 2, 45, 6, 60, 13]
@pytest.mark.parametrize("target", ["F32"])
def test_t(gguf_models, target):
    path, _ = gguf_models("small", target)
    cpu = LLM(path, device="cpu", max_context=256)
    t0 = time.perf_counter(); cpu.score(PROMPT); t1 = time.perf_counter()
    cpu.generate(PROMPT, max_tokens=8, temperature=0, ignore_eos=True); t2 = time.perf_counter()
    print(f"\n{target}: score {t1-t0:.1f} s, generate {t2-t1:.1f} s")
