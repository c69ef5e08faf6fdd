#!/usr/bin/env bash
# Checks `ferrox bench serve` against guidellm, an independent load generator:
# one `ferrox serve`, the same workload (chat endpoint, ~100 prompt tokens,
# 32 output tokens, 60 requests at a constant 1.5 requests/s) from each client
# in turn; prints output tok/s and mean TTFT of both.
#
#   pip install guidellm   # in its own virtual environment if you like
#   bash benches/loadgen_vs_guidellm.sh [path/to/guidellm] [port]
set -euo pipefail
cd "$(dirname "$0")/.."
guidellm=${1:-guidellm}
port=${2:-8013}
out=$(mktemp -d)
# The bundled model written out as a Hugging Face directory (guidellm needs one
# for its tokenizer).
model=$(python3 -c "import sys; sys.path.insert(0, 'benches'); import side_by_side; print(side_by_side.hf_directory())")
ferrox serve --model "$model" --served-model-name "$model" --port "$port" --log-level warning &
server=$!
trap 'kill -INT $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 300); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  sleep 1
done
url="http://127.0.0.1:$port"

ferrox bench serve --base-url "$url" --endpoint chat --dataset-name random \
  --random-input-len 100 --random-output-len 32 --random-range-ratio 0 \
  --num-prompts 60 --request-rate 1.5 --burstiness 1000 --ignore-eos \
  --tokenizer "$model" --result-dir "$out/ferrox" >"$out/ferrox.log" 2>&1

"$guidellm" run --disable-console-interactive \
  --backend "kind=openai_http,target=$url,model=$model,request_format=/v1/chat/completions" \
  --profile kind=constant,rate=1.5 --constraint kind=max_requests,count=60 \
  --data kind=synthetic_text,prompt_tokens=100,output_tokens=32 \
  --output "kind=json,path=$out/guidellm.json" >"$out/guidellm.log" 2>&1

python3 - "$out" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
f = json.loads(next((out / "ferrox").glob("*.json")).read_text())
f = f[0] if isinstance(f, list) else f
g = json.loads((out / "guidellm.json").read_text())["benchmarks"][0]["metrics"]
g_tok = g["output_tokens_per_second"]["successful"]["mean"]
g_ttft = g["time_to_first_token_ms"]["successful"]["mean"]
print(f"ferrox bench serve: {f['output_throughput']:.1f} output tok/s, TTFT mean {f['mean_ttft_ms']:.0f} ms")
print(f"guidellm:           {g_tok:.1f} output tok/s, TTFT mean {g_ttft:.0f} ms")
EOF
echo "logs and JSON: $out"
