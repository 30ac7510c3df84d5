# Caddy from Debian's package (2.6), for compose.offline.yaml: the official caddy image's
# layout (/etc/caddy/Caddyfile, state in /data and /config).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends caddy \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /config /data /etc/caddy
COPY offline/caddy-entrypoint.sh /usr/local/bin/caddy-entrypoint.sh
ENV XDG_CONFIG_HOME=/config \
    XDG_DATA_HOME=/data
EXPOSE 80 443
ENTRYPOINT ["sh", "/usr/local/bin/caddy-entrypoint.sh"]
