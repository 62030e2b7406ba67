# kvtier's container image: kvtierd, kvtier-agent and kvtierctl on slim Debian, run as an
# unprivileged user (uid/gid 10001), health-checked through grpc.health.v1.
#
#   docker build -t kvtier:0.1.0 .            (or: podman build --format docker ...)
#   docker run --rm -v /run/kvtier:/run/kvtier --shm-size 1g kvtier:0.1.0
#
# The same image runs the agent: --entrypoint kvtier-agent (see deploy/k8s and docs/DEPLOY.md).
# Both base images can be replaced (a mirror, a pinned digest) with --build-arg.
ARG RUST_IMAGE=docker.io/library/rust:1.95-slim-bookworm
ARG RUNTIME_IMAGE=docker.io/library/debian:bookworm-slim

# --- build ---------------------------------------------------------------------------------
FROM ${RUST_IMAGE} AS builder
# Debian's RocksDB is linked (.cargo/config.toml), so no C++ build; libclang for bindgen.
RUN apt-get update \
 && apt-get install -y --no-install-recommends librocksdb-dev libclang-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The registry and target caches survive between builds on one builder (BuildKit, buildah).
# COPY keeps the files' times, and cargo judges a crate fresh by them: the target cache may
# hold an artifact built later from another tree, which would be taken for this one's. So
# the workspace's sources are touched first (its crates always build; dependencies stay
# cached).
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    find crates benches proto -type f -exec touch {} + \
 && cargo build --release --locked -p kvtier-daemon -p kvtier-agent -p kvtier-ctl \
 && install -D -s -m 0755 -t /out/bin \
      target/release/kvtierd target/release/kvtier-agent target/release/kvtierctl

# --- run -----------------------------------------------------------------------------------
FROM ${RUNTIME_IMAGE} AS runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends librocksdb7.8 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 kvtier \
 && useradd --system --uid 10001 --gid kvtier --no-create-home --home-dir /var/lib/kvtier \
      --shell /usr/sbin/nologin kvtier \
 && install -d -o kvtier -g kvtier -m 0750 /var/lib/kvtier /run/kvtier
COPY --from=builder /out/bin/ /usr/local/bin/
COPY deploy/container/kvtierd.toml deploy/container/kvtier-agent.toml /etc/kvtier/
USER 10001:10001
WORKDIR /var/lib/kvtier
# Prometheus text endpoints of kvtierd and the agent; the optional TCP listener.
EXPOSE 9464 9465 7070
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD ["kvtierctl", "health", "--socket", "/run/kvtier/kvtierd.sock"]
# SIGTERM drains in-flight requests, removes the socket and unlinks the pools.
STOPSIGNAL SIGTERM
ENTRYPOINT ["kvtierd", "--config", "/etc/kvtier/kvtierd.toml"]
