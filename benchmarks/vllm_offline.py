"""Run by `offline_throughput.py --vllm PYTHON` with vLLM's interpreter: the same requests
through vLLM's offline `LLM.generate`; prints {"seconds": ...} (the timed run, after a
warm-up). Standalone: vLLM's venv has no kvray.

    python vllm_offline.py requests.json   # {"model", "dtype", "requests": [[ids, max_tokens], ...]}
"""

import json
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.load(open(sys.argv[1]))
    llm = LLM(model=spec["model"], dtype=spec["dtype"], enforce_eager=True, max_model_len=2048, seed=0)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in spec["requests"]]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in spec["requests"]]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    print(json.dumps({"seconds": time.perf_counter() - start}))


if __name__ == "__main__":
    main()
