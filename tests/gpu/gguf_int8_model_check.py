"""The GGUF model with its GEMVs on int8 inputs (``int8_inputs``: Q8_0, Q2_K and IQ2_XXS) against its float GEMVs,
on llama.cpp's tiny quantised files (tests/fixtures/gguf_v4): a 150-token prompt and three greedy decode steps
each way (``tests/unit/test_dsv4_gguf_native.py``'s driver).  Prints, per file, whether the prompt's logits are
the same bit for bit (a prompt step takes no GEMV), the decode steps' largest difference over the largest logit,
and both greedy continuations.  Any machine: Triton's interpreter (about 10 minutes for the three files on one
core), or a GPU.

    TRITON_INTERPRET=1 PYTHONPATH=. python3 tests/gpu/gguf_int8_model_check.py
"""

from __future__ import annotations

import torch

from tests.unit.test_dsv4_gguf_native import PROMPT, _load, _run

FILES = [("quant-IQ2_XXS.gguf", {"IQ2_XXS", "Q2_K", "Q8_0"}), ("quant-Q2_K.gguf", {"Q2_K", "Q8_0"}),
         ("converted.gguf", {"Q8_0"})]
"""Each file, and the types of its blocks that have an int8 GEMV."""


def main() -> None:
    torch.set_num_threads(1)
    n = len(PROMPT)
    print("| file | int8 types | prompt logits equal | decode steps' difference | greedy ids, int8 | float |")
    print("|---|---|---|---|---|---|")
    for name, types in FILES:
        want, want_ids = _run(_load(name, native=True))
        got, got_ids = _run(_load(name, native=True, int8_inputs=True))
        difference = ((got[n:] - want[n:]).abs().max() / want[n:].abs().max()).item()
        print(f"| {name} | {', '.join(sorted(types))} | {torch.equal(got[:n], want[:n])} | {difference:.1e} | "
              f"{got_ids} | {want_ids} |")


if __name__ == "__main__":
    main()
