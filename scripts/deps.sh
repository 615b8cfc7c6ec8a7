#!/usr/bin/env bash
# Installs the Debian packages deepinfer needs to build and test (idempotent; quiet when all are
# present). Run as root or with sudo available.
set -euo pipefail
pkgs=(build-essential cmake pkg-config libjansson-dev libpcre2-dev zlib1g-dev libicu-dev libmicrohttpd-dev libcurl4-openssl-dev python3-venv clang libclang-rt-14-dev)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "deepinfer: installing Debian packages: ${missing[*]}" >&2
    sudo=""
    [[ $(id -u) -ne 0 ]] && sudo=sudo
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi
