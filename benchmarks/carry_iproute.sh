#!/usr/bin/env bash
# Copies this host's iproute2 (`ip`, `tc`) and the libraries they load into .iproute/, for a
# host that has none (the lent GPU hosts' image): there, `PATH=$PWD/.iproute/bin:$PATH` makes
# benchmarks/lm_link_host.sh and benchmarks/network.py find them. Each tool runs through that
# host's own loader with .iproute/lib as its library path, which applies to the tool alone, not
# to the programs `ip netns exec` starts. glibc itself (libc, libm) is not copied: the target's
# is used, so it must be as new as this host's (Debian 12's 2.36 here; Ubuntu 24.04's 2.39 there).
set -euo pipefail
dest=${1:-.iproute}
rm -rf "$dest"
mkdir -p "$dest/bin" "$dest/lib" "$dest/real"
for tool in ip tc; do
  path=$(command -v "$tool")
  cp "$path" "$dest/real/"
  for lib in $(ldd "$path" | awk '/=>/ {print $3}'); do
    case $(basename "$lib") in
      libc.so.*|libm.so.*) ;;
      *) cp -L "$lib" "$dest/lib/" ;;
    esac
  done
  cat > "$dest/bin/$tool" <<WRAP
#!/bin/sh
d=\$(dirname "\$(readlink -f "\$0")")/..
exec /lib64/ld-linux-x86-64.so.2 --library-path "\$d/lib" "\$d/real/$tool" "\$@"
WRAP
  chmod +x "$dest/bin/$tool"
done
"$dest/bin/ip" -V && "$dest/bin/tc" -V
echo "wrote $dest ($(du -sh "$dest" | cut -f1)); carry it and put $dest/bin first on PATH"
