# Sourced by the scripts a lent GPU machine runs (gpu-runbooks.sh, kernel-ab.sh): `carried_wheels SITE` installs
# the wheels carried in .whl/ (scripts/device-wheels.sh makes them) into SITE and puts SITE and the tree on
# PYTHONPATH; without carried wheels, the tree alone. Exit 3 when they do not install.
carried_wheels() {
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$1" .whl/*.whl \
      || { echo "could not install the carried wheels" >&2; exit 3; }
    export PYTHONPATH=$1:$PWD
  else
    export PYTHONPATH=$PWD
  fi
}
