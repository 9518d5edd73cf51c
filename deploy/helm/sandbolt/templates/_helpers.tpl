{{/* Base name of every object. */}}
{{- define "sandbolt.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "sandbolt.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels; call with (dict "ctx" $ "component" "agent"). */}}
{{- define "sandbolt.selector" -}}
app.kubernetes.io/name: {{ .ctx.Chart.Name }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "sandbolt.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "sandbolt.secretName" -}}
{{- default (printf "%s-tokens" (include "sandbolt.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{- define "sandbolt.serviceAccount" -}}
{{- if .ctx.Values.serviceAccount.create -}}
{{- printf "%s-%s" (include "sandbolt.fullname" .ctx) .component -}}
{{- else -}}
default
{{- end -}}
{{- end -}}

{{/* In-cluster URL of the controller's FastPath + RegistryService port
(https:// with values "tls" on). */}}
{{- define "sandbolt.controllerUrl" -}}
{{- printf "%s://%s-fastpath.%s.svc:%d" (ternary "https" "http" .Values.tls.enabled) (include "sandbolt.fullname" .) .Release.Namespace (int .Values.controller.fastpath.port) -}}
{{- end -}}

{{/* The Secret with the controller's TLS certificate (tls.crt, tls.key)
and its CA (ca.crt): values tls.secretName, else the one the chart makes. */}}
{{- define "sandbolt.tlsSecret" -}}
{{- default (printf "%s-tls" (include "sandbolt.fullname" .)) .Values.tls.secretName -}}
{{- end -}}

{{- define "sandbolt.checkValues" -}}
{{- if not (has .Values.controller.consistency (list "strong" "fast")) -}}
{{- fail (printf "controller.consistency must be strong or fast, not %q" .Values.controller.consistency) -}}
{{- end -}}
{{- if not (has .Values.controller.store (list "kubernetes" "embedded")) -}}
{{- fail (printf "controller.store must be kubernetes or embedded, not %q" .Values.controller.store) -}}
{{- end -}}
{{- if and (eq .Values.controller.store "embedded") (gt (int .Values.controller.replicas) 1) -}}
{{- fail "controller.replicas > 1 needs controller.store=kubernetes (leader election); the embedded store has a single writer" -}}
{{- end -}}
{{- if not .Values.pools -}}
{{- fail "pools must name at least one pool" -}}
{{- end -}}
{{- $names := list -}}
{{- range .Values.pools -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]{0,28}[a-z0-9])?$" (toString .name)) -}}
{{- fail (printf "pool name %q must be a DNS label of at most 30 characters" (toString .name)) -}}
{{- end -}}
{{- if has .name $names -}}
{{- fail (printf "pool %q is listed twice" .name) -}}
{{- end -}}
{{- $names = append $names .name -}}
{{- if not (has (default "runc" .runtime) (list "runc" "crun" "runsc")) -}}
{{- fail (printf "pool %q: runtime must be runc, crun or runsc, not %q" .name .runtime) -}}
{{- end -}}
{{- if and (eq (default "runc" .runtime) "runsc") (ne $.Values.agent.network "egress") -}}
{{- fail (printf "pool %q: runtime runsc needs agent.network=egress: gVisor's network stack runs on the sandbox's own veth, and its agents refuse runsc without sandbox networking" .name) -}}
{{- end -}}
{{- with .runsc -}}
{{- if not (has (default "ptrace" .platform) (list "ptrace" "kvm")) -}}
{{- fail (printf "pools[].runsc.platform must be ptrace or kvm, not %q" .platform) -}}
{{- end -}}
{{- if not (has (default "none" .overlay) (list "none" "memory")) -}}
{{- fail (printf "pools[].runsc.overlay must be none or memory, not %q" .overlay) -}}
{{- end -}}
{{- end -}}
{{- if lt (int (default 256 .maxSandboxesPerAgent)) 1 -}}
{{- fail (printf "pool %q: maxSandboxesPerAgent must be at least 1" .name) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Environment every component shares: logging. */}}
{{- define "sandbolt.logEnv" -}}
- name: SANDBOLT_LOG
  value: {{ .Values.log.level | quote }}
{{- if .Values.log.json }}
- name: SANDBOLT_LOG_JSON
  value: "true"
{{- end }}
{{- end -}}

{{/* The limits of every listener of the controller, agents and lifecycle
     (README "Timeouts and caps on every listener"), as the environment
     their listener flags read. Numbers go through int64: a large YAML number
     would otherwise render in exponent form. */}}
{{- define "sandbolt.listenerEnv" -}}
{{- with .Values.listenerLimits }}
- name: SANDBOLT_MAX_CONNECTIONS
  value: {{ .maxConnections | int64 | quote }}
- name: SANDBOLT_HEADER_READ_TIMEOUT
  value: {{ .headerReadTimeout | quote }}
- name: SANDBOLT_IDLE_TIMEOUT
  value: {{ .idleTimeout | quote }}
- name: SANDBOLT_HTTP2_KEEPALIVE_INTERVAL
  value: {{ .http2KeepaliveInterval | quote }}
- name: SANDBOLT_MAX_BODY_BYTES
  value: {{ .maxBodyBytes | int64 | quote }}
{{- end }}
{{- end -}}

{{- define "sandbolt.agentTokenEnv" -}}
- name: SANDBOLT_AGENT_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "sandbolt.secretName" . }}
      key: {{ .Values.auth.agentTokenKey }}
{{- end -}}

{{/* The pod annotations a Prometheus discovering pods by annotation
     scrapes; call with (dict "ctx" $ "port" <ops port>). */}}
{{- define "sandbolt.scrapeAnnotations" -}}
{{- if .ctx.Values.metrics.annotations -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end -}}
{{- end -}}
