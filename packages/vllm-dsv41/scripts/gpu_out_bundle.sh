# Sourced by gpu_env.sh (at the exit of every device script that sources it) and by gpu_all_tests.sh.
# $OUT comes back only up to 8 files (16 MiB each, 2 folders down): at exit, when more are there, every file but the
# *steps.log files and jitcache.tgz goes into one $OUT/bundle-HHMMSS.tgz (files over 12 MiB stay out and are named).
gpu_out_bundle() {
    [ -n "${OUT:-}" ] && [ -d "$OUT" ] || return 0
    [ "$(find "$OUT" -type f | wc -l)" -le 8 ] && return 0
    local b list=/tmp/dsv41-bundle.list
    b="bundle-$(date +%H%M%S).tgz"
    (
        cd "$OUT" || exit 0
        find . -type f ! -name '*steps.log' ! -name jitcache.tgz ! -name 'bundle-*.tgz' -size -12M | sort > "$list"
        tar czf "/tmp/$b" -T "$list" && xargs -d '\n' rm -f < "$list" && mv "/tmp/$b" "$b"
        find . -mindepth 1 -type d -empty -delete
        find . -type f -size +12M -printf 'gpu_out_bundle: left out of the bundle (over 12 MiB): %p %s B\n'
        echo "gpu_out_bundle: $(wc -l < "$list") files of \$OUT in \$OUT/$b"
    )
}
