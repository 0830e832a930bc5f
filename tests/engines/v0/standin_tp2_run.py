"""Run the stand-in's engine at tensor parallel 2 in a fresh process; print what it produced.

A separate process because vLLM's process groups are per process: a TP 1 engine (or any test
that set up vLLM's TP-1 groups) in the pytest process would make a TP 2 engine there refuse to
start. Usage: ``python standin_tp2_run.py MODEL_DIR PROMPTS_JSON CHUNK NEW_TOKENS``; prints one
JSON line: the executor class, the tensor parallel size and the greedy token ids per prompt.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    model_dir, prompts_json, chunk, new_tokens = sys.argv[1:]
    from vllm import LLM, SamplingParams

    prompts: dict[str, list[int]] = json.loads(prompts_json)
    llm = LLM(
        model=model_dir,
        dtype="float32",
        enforce_eager=True,
        seed=0,
        tensor_parallel_size=2,
        enable_chunked_prefill=True,
        max_num_batched_tokens=int(chunk),
        max_num_seqs=4,
        enable_prefix_caching=True,
        max_model_len=512,
        swap_space=0.05,
    )
    params = SamplingParams(temperature=0.0, max_tokens=int(new_tokens), ignore_eos=True)
    names = list(prompts)
    # one request after another, then all at once (chunked prefills beside decodes, prefix hits)
    got = {}
    for name in names:
        (out,) = llm.generate([{"prompt_token_ids": prompts[name]}], params, use_tqdm=False)
        got[name] = list(out.outputs[0].token_ids)
    outs = llm.generate([{"prompt_token_ids": prompts[n]} for n in names], params, use_tqdm=False)
    batched = {n: list(o.outputs[0].token_ids) for n, o in zip(names, outs, strict=True)}
    executor = type(llm.llm_engine.model_executor).__name__
    tp = llm.llm_engine.parallel_config.tensor_parallel_size
    print(json.dumps({"executor": executor, "tp": tp, "one_by_one": got, "batched": batched}))
    sys.stdout.flush()
    llm.llm_engine.model_executor.shutdown()


if __name__ == "__main__":
    main()
