"""A multi-agent workflow against `vllm serve` with the pbkv connector (docs/vllm.md).

    python examples/vllm_client.py --base-url http://127.0.0.1:8000/v1 --model MODEL

Each call carries the workflow hints in `kv_transfer_params` (through the openai client's
`extra_body`); the last call of a workflow sets `workflow_done`, so its cache retires at once.
"""

import argparse
import sys
import uuid

import openai
from openai import OpenAI

AGENTS = ["planner", "researcher", "writer"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", required=True)
    ap.add_argument("--workflows", type=int, default=3)
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="unused")
    try:
        run(client, args)
    except openai.APIConnectionError as e:   # one line naming the URL, not a traceback
        sys.exit(f"vllm_client.py: cannot reach the server at {args.base_url}: {e}")
    except openai.APIStatusError as e:
        sys.exit(f"vllm_client.py: the server at {args.base_url} answered {e.status_code}: {e.message}")


def run(client: OpenAI, args) -> None:
    for _ in range(args.workflows):
        workflow_id = f"task-{uuid.uuid4().hex[:8]}"
        history = [{"role": "system", "content": "You are one agent of a small team."},
                   {"role": "user", "content": "Summarise why KV-cache reuse matters for agents."}]
        for i, agent in enumerate(AGENTS):
            reply = client.chat.completions.create(
                model=args.model, messages=history + [{"role": "user", "content": f"You are the {agent}."}],
                max_tokens=64, temperature=0,
                extra_body={"kv_transfer_params": {"workflow_id": workflow_id, "agent": agent,
                                                   "workflow_done": i == len(AGENTS) - 1}})
            text = reply.choices[0].message.content
            history.append({"role": "assistant", "content": text})
            print(f"{workflow_id} {agent}: {text[:70]!r}")


if __name__ == "__main__":
    main()
