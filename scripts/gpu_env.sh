# Sourced by the GPU scripts: run the checkout's sources, and import the wheels staged in $WHEELS (default
# .stage/wheels: e.g. gguf and platformdirs, which a bare GPU machine lacks and cannot download) straight from the
# .whl files, without installing anything.
for wheel in "${WHEELS:-.stage/wheels}"/*.whl; do
  [ -f "$wheel" ] || continue
  case $wheel in /*) ;; *) wheel=$PWD/$wheel ;; esac
  PYTHONPATH=$wheel${PYTHONPATH:+:$PYTHONPATH}
done
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
