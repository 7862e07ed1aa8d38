#!/bin/sh
# `pip install` during the image build. Behind an intercepting TLS proxy, pass its CA bundle as a build secret
# (`--secret id=pip_ca,src=/path/to/ca-bundle.pem`): it is mounted read-only at /run/secrets/pip_ca for the
# steps that install (never stored in a layer, never over the image's /etc/ssl/certs) and pip trusts it
# through PIP_CERT.
set -eu
if [ -s /run/secrets/pip_ca ]; then
    export PIP_CERT=/run/secrets/pip_ca
fi
# NGC's Python is the system one and the image is its only user, so pip may install into it.
export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
exec python -m pip install "$@"
