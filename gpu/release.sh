# Sourced by the carry scripts on the dev machine (fetch_wheels.sh, pack_site.sh, build_carry.sh)
# and by device_env.sh on the device: the SGLang release whose site they build or unpack,
# SGLANG_RELEASE (default 0.5.11), as REL, and the suffix of its carried folders, SFX ("" for
# 0.5.11: .whl1 .whl3; "-0.5.17": .whl1-0.5.17 .whl3-0.5.17; "-0.5.23" likewise).
REL=${SGLANG_RELEASE:-0.5.11}
case $REL in
  0.5.11) SFX="" ;;
  0.5.17|0.5.23) SFX=-$REL ;;
  *) echo "SGLANG_RELEASE=$REL: only 0.5.11 (default), 0.5.17 or 0.5.23" >&2; exit 2 ;;
esac
