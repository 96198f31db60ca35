#!/usr/bin/env bash
# Wheels that bench/gpu_check.py needs on the device machine (Python 3.12 on x86-64, no network there), put in .whl/
# here, where pip reaches PyPI. One set per run stays under the 64 MiB a run carries:
#   transformers  pydantic + xgrammar (textgen's transformers backend) and bitsandbytes      (about 48 MB)
#   exllama       pydantic + exllamav2 and exllamav3 with the packages they need that are not there
# Then: run(carry=[".whl"], command="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir
#   --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && PYTHONUNBUFFERED=1
#   python3 bench/gpu_check.py --only transformers")   (or --only exllama)
set -euo pipefail
cd "$(dirname "$0")/.."
which=${1:?usage: bench/gpu_wheels.sh transformers|exllama}
pydantic="pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0"
case "$which" in
  transformers) packages="$pydantic xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 bitsandbytes==0.50.2" ;;
  exllama) packages="$pydantic exllamav2==0.3.2 exllamav3==1.6.5 fastparquet==2026.9.0 cramjam==2.14.0 websockets==17.4 marisa-trie==1.4.1 llguidance==1.9.1" ;;
  *) echo "usage: bench/gpu_wheels.sh transformers|exllama" >&2; exit 2 ;;
esac
rm -rf .whl && mkdir .whl
platforms=""
for n in 1 2014 2_17 2_24 2_27 2_28 2_31 2_34 2_35; do
  case $n in 1|2014) platforms="$platforms --platform manylinux${n}_x86_64" ;; *) platforms="$platforms --platform manylinux_${n}_x86_64" ;; esac
done
python=python3
[ -x .venv/bin/python ] && python=.venv/bin/python
# shellcheck disable=SC2086
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms -d .whl $packages
du -sh .whl
