"""Does the server's automatic speculation still draft for a lone request after mixed traffic?

    specdecode serve --port 8777 &            # the embedded model, its defaults
    python scripts/policy_after_mixed_traffic.py --url http://127.0.0.1:8777

Two rounds of 8 concurrent chats (n=2, greedy, 48 tokens: 16 rows whose drafts rarely pay, so the
policy switches the batch off for cost), then the same Predicted Output request (a copy whose
prediction is its answer's source) three times alone. Prints each lone request's drafted and
accepted tokens and steps, and the policy's switch counters. Before 2026-11-27 the batch's switch,
made with the chats' acceptance, also held for the lone request that came after them: its first
run drafted 17 tokens in 57 steps, the later ones 100 in 26.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf

import httpx

PROMPTS = ["Write a short poem about the sea.", "Tell me a joke about cats.", "Describe a sunset in three sentences.",
           "What is your favourite colour and why?", "Invent a name for a new fruit.", "Write a haiku about rain.",
           "Give me a motivational quote.", "Describe a dragon."]
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8777")
    args = p.parse_args()

    def chat(body: dict) -> dict:
        r = httpx.post(args.url + "/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        return r.json()
    for _ in range(2):
        with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
            list(pool.map(lambda q: chat({"messages": [{"role": "user", "content": q}], "max_tokens": 48,
                                          "temperature": 0, "n": 2}), PROMPTS))
    ask = {"messages": [{"role": "user", "content": "Repeat this code exactly:\n" + CODE}], "max_tokens": 60,
           "temperature": 0, "prediction": {"type": "content", "content": CODE}}
    for i in range(3):
        s = chat(ask)["speculation"]
        print(f"lone request {i}: drafted {s['drafted_tokens']}, accepted {s['accepted_tokens']}, steps {s['steps']}, "
              f"on at its end: {s['on_at_end']}")
    metrics = httpx.get(args.url + "/metrics", timeout=30).text
    for line in metrics.splitlines():
        if line.startswith(("specdecode:spec_decode_auto_disabled_total{", "specdecode:spec_decode_auto_enabled_total{",
                            "specdecode:spec_decode_batch_disabled ")):
            print(line)


if __name__ == "__main__":
    main()
