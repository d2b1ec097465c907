# The project venv, shared by scripts/main and scripts/test. Sourced with $repo set; defines
# $venv. The venv lives in the repo so a fresh clone needs nothing but python3. The stamp records
# a finished install: it is written last, so an interrupted install is redone on the next run,
# and it is compared with pyproject.toml so that a changed dependency list reinstalls.

_venv_setup() {
    local python="${PYTHON:-python3}" stamp
    venv="$repo/.venv"
    stamp="$venv/.installed"
    if [[ ! -x "$venv/bin/python" ]]; then
        "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
            || { echo "$python is older than Python 3.11" >&2; return 1; }
        "$python" -m venv "$venv" || return 1
    fi
    if [[ ! "$stamp" -nt "$repo/pyproject.toml" ]]; then
        echo "installing the project and its dependencies into $venv ..." >&2
        # torch is pinned to ==2.13.0 in the extras: an unpinned torch would pull GBs of CUDA.
        "$venv/bin/python" -m pip install --quiet --quiet --no-input -e "$repo[torch,plot,dev]" \
            || return 1
        touch "$stamp"
    fi
    # The editable install leaves our own modules uncompiled, and where PYTHONDONTWRITEBYTECODE
    # is set (this CI's environment) every process compiles them again: 0.15 s per process here,
    # 4-6 s in the soft-RoCE guest, and the tests start hundreds. Up-to-date files are skipped.
    # (compileall does not follow reduction_appliance/'s links to the top-level packages; a file
    # that does not compile is for the stages that follow to report.)
    "$venv/bin/python" -m compileall -q -j 0 "$repo"/{reduction_appliance,tests,examples} \
        "$repo"/{bench,control,dataplane,deploy,plugin} > /dev/null || true
}
