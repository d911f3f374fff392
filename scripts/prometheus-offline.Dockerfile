# A stand-in for prom/prometheus where no image registry is reachable: Debian's prometheus
# binary (and busybox for the healthcheck's wget, as in the official image) on the smoke's
# debootstrapped base. Built by scripts/docker-smoke.sh from a context holding the two
# binaries; used through docker-compose.offline.yml. Not for production.
ARG BASE_IMAGE=kvserve-base:bookworm
FROM ${BASE_IMAGE}
COPY prometheus busybox /bin/
RUN ln -s /bin/busybox /bin/wget \
    && mkdir -p /etc/prometheus /prometheus \
    && chown nobody:nogroup /prometheus
USER 65534:65534
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
