"""A tiny Llama made locally as a Hugging Face folder, for tests and CPU benchmarks of the LLM
path: random weights, a byte-level BPE trained on generated text, a chat template. No hub.

Building needs transformers and tokenizers, which live in the LLM venv (.venv-llm), not in the
flow's venv: `build_tiny_llm` runs there itself when this interpreter lacks them.

    python -m prefect_ray_lifecycle.workloads.llm.tiny OUT_DIR
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

from prefect_ray_lifecycle.workloads.constants import PROJECT_ROOT, llm_python

# The CPU attention backend rejects head_dim 16, hence 4 heads of 32 over a hidden size of 64.
TINY_LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "max_position_embeddings": 512,
}
VOCAB_SIZE = 1024
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
# Plain role-tagged turns; the generation prompt ends with the assistant tag.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_WORDS = (
    "ray serve flow task model version canary router replica token prompt champion "
    "challenger rollout health latency batch cluster policy checkpoint metric the a of to "
    "and is in on with for by from when then only every each new old live desired"
).split()


def _corpus(lines: int, seed: int) -> list[str]:
    """Sentences of domain words, numbers and made-up syllable words: enough distinct pairs
    for the BPE to reach its full vocabulary."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"]

    def word() -> str:
        roll = rng.random()
        if roll < 0.5:
            return rng.choice(_WORDS)
        if roll < 0.6:
            return str(rng.randint(0, 9999))
        return "".join(rng.choice(syllables) for _ in range(rng.randint(1, 4)))

    return [" ".join(word() for _ in range(rng.randint(4, 16))) + "." for _ in range(lines)]


def _has_builder_deps() -> bool:
    return all(importlib.util.find_spec(m) for m in ("transformers", "tokenizers", "torch"))


def build_tiny_llm(
    out_dir: str | os.PathLike, seed: int = 0, python: str | os.PathLike | None = None
) -> Path:
    """Write the tiny model's HF folder to `out_dir` (created) and return its path. Runs in the
    LLM venv's `python` (default: workloads.constants.llm_python()) when this one lacks
    transformers."""
    out = Path(out_dir).resolve()
    if not _has_builder_deps():
        builder = Path(llm_python(os.fspath(python) if python else None))
        if not builder.exists():
            raise FileNotFoundError(
                f"building the tiny LLM needs transformers and tokenizers: not in {sys.executable}"
                f" and no LLM venv python at {builder} (run `make llm-venv`)"
            )
        result = subprocess.run(
            [
                str(builder),
                "-m",
                "prefect_ray_lifecycle.workloads.llm.tiny",
                str(out),
                "--seed",
                str(seed),
            ],
            cwd=PROJECT_ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"building the tiny LLM in {builder} failed:\n{result.stderr[-3000:]}"
            )
        return out
    _build_here(out, seed)
    return out


def _build_here(out: Path, seed: int) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    unk, bos, eos = SPECIAL_TOKENS
    tokenizer = Tokenizer(models.BPE(unk_token=unk))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(5000, seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token=unk,
        bos_token=bos,
        eos_token=eos,
        pad_token=eos,
        model_max_length=TINY_LLAMA["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(fast),
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=True,
        dtype="float32",
        **TINY_LLAMA,
    )
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": fast.bos_token_id,
                "eos_token_id": fast.eos_token_id,
                "pad_token_id": fast.pad_token_id,
            }
        )
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(build_tiny_llm(args.out_dir, seed=args.seed))


if __name__ == "__main__":
    main()
