"""Run llama.cpp's own convert_hf_to_gguf.py (from a llama.cpp source tree, e.g. the llama-cpp-python sdist's
vendor/llama.cpp) on an HF directory, its vocabulary written by our tokenizer writer instead: the tests' tiny
tokenizer is none its GLM / GPT vocab readers know. Usage: python llama_convert.py LLAMA_CPP_DIR HF_DIR OUT TYPE
[CONVERTER OPTION ...]."""
import runpy
import sys


def main(llama_cpp, hf_dir, out, outtype, *options):
    import json

    sys.path[:0] = [f"{llama_cpp}/gguf-py", llama_cpp]  # its own gguf-py, as its converter expects
    import conversion

    from hybrid.formats.gguf_tokenizer import add_tokenizer_to_writer
    from hybrid.tokenizer import Tokenizer

    def set_vocab(self):
        add_tokenizer_to_writer(self.gguf_writer, Tokenizer.from_hf_dir(hf_dir))

    with open(f"{hf_dir}/config.json") as f:
        for arch in json.load(f)["architectures"]:
            conversion.get_model_class(arch).set_vocab = set_vocab
    sys.argv = ["convert_hf_to_gguf.py", hf_dir, "--outfile", out, "--outtype", outtype, *options]
    runpy.run_path(f"{llama_cpp}/convert_hf_to_gguf.py", run_name="__main__")

if __name__ == "__main__":
    main(*sys.argv[1:])
