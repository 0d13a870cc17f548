# The app as a static binary in a distroless image, running as non-root.
# It cannot be built on the machines this project is developed on (no
# Docker there); cmd/app's TestDockerfileBuildsWhatCIBuilds checks that its
# build command compiles with the flags it names.
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/app ./cmd/app

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/app /app
USER nonroot:nonroot
# /metrics, /healthz, /readyz
EXPOSE 9464
ENV ONCE_OPS_LISTEN=0.0.0.0:9464
ENTRYPOINT ["/app"]
CMD ["serve"]
