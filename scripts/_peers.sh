# Sourced by test.sh: the real peers tests/test_real_peers.py and
# tests/test_httpx_proxy.py run (GnuTLS, stunnel, haproxy, nginx, openssl,
# tinyproxy), from Debian's packages.
# As root with apt-get, missing ones are installed; otherwise their tests
# skip, each naming its package.
peers_missing=()
for pair in gnutls-serv:gnutls-bin gnutls-cli:gnutls-bin stunnel:stunnel4 \
            haproxy:haproxy nginx:nginx-light openssl:openssl tinyproxy:tinyproxy; do
    program=${pair%%:*} package=${pair#*:}
    if ! PATH="$PATH:/usr/sbin:/sbin" command -v "$program" >/dev/null; then
        case " ${peers_missing[*]} " in
            *" $package "*) ;;
            *) peers_missing+=("$package") ;;
        esac
    fi
done
if [ ${#peers_missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "== apt-get install ${peers_missing[*]} (peers for tests/test_real_peers.py, tests/test_httpx_proxy.py)"
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -q --no-install-recommends "${peers_missing[@]}" >/dev/null \
            || { apt-get update -q >/dev/null \
                 && apt-get install -y -q --no-install-recommends "${peers_missing[@]}" >/dev/null; }
    else
        echo "== not installed: ${peers_missing[*]}: their tests in tests/test_real_peers.py and tests/test_httpx_proxy.py skip" \
             "(scripts/test.sh installs them when run as root with apt-get)"
    fi
fi
