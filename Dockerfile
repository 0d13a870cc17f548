# The app as a static binary in a distroless image, running as non-root: the
# image for registries. It cannot be built on the machines this project is
# developed on (no Docker, no registry to pull the base images from); there
# dev/image.sh builds the same binary and the same runtime stage on scratch
# (dev/image/Containerfile) with podman. cmd/app's
# TestDockerfileBuildsWhatCIBuilds runs the build line below and checks the
# two agree.
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
# The build's flags live in dev/build-app.sh, shared with dev/image.sh.
RUN sh dev/build-app.sh /out/app

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/app /app
# nonroot, by number: Kubernetes' runAsNonRoot can verify a number, not a name.
USER 65532:65532
# /metrics, /healthz, /readyz
EXPOSE 9464
ENV ONCE_OPS_LISTEN=0.0.0.0:9464
ENTRYPOINT ["/app"]
CMD ["serve"]
