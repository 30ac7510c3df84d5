#!/bin/sh
# Debian's Caddy is 2.6, and stream_close_delay came in 2.7: the Caddyfile runs without it
# (a reload then cuts workers' websockets at once; they reconnect).
set -eu
sed '/^[[:space:]]*stream_close_delay[[:space:]]/d' /etc/caddy/Caddyfile > /config/Caddyfile
exec caddy run --config /config/Caddyfile --adapter caddyfile
