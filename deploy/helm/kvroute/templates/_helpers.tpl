{{/* Chart name. */}}
{{- define "kvroute.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-scoped name of every object. */}}
{{- define "kvroute.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "kvroute.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "kvroute.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvroute.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvroute.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvroute.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "kvroute.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "kvroute.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvroute.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvroute.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Whether this release runs kvroute serve (not the sidecar mode). */}}
{{- define "kvroute.router" -}}
{{- if has .Values.mode (list "service" "endpoint-picker") -}}true{{- end -}}
{{- end -}}

{{- define "kvroute.redisUrl" -}}
{{- if .Values.redis.url -}}
{{- .Values.redis.url -}}
{{- else if and .Values.redis.enabled (include "kvroute.router" .) -}}
{{- printf "redis://%s-redis:6379/0" (include "kvroute.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The pod label selector discovery watches. */}}
{{- define "kvroute.engineSelector" -}}
{{- if eq .Values.mode "endpoint-picker" -}}
{{- $terms := list -}}
{{- range $key, $value := .Values.inferencePool.selector -}}
{{- $terms = append $terms (printf "%s=%s" $key $value) -}}
{{- end -}}
{{- join "," $terms -}}
{{- else -}}
{{- .Values.discovery.labelSelector -}}
{{- end -}}
{{- end -}}

{{/* kvroute serve's YAML configuration (docs/configuration.md). */}}
{{- define "kvroute.config" -}}
{{- $server := dict "host" "0.0.0.0" "port" (int .Values.router.port) "log_level" .Values.router.logLevel "log_format" .Values.router.logFormat "access_log" .Values.router.accessLog "drain_timeout_s" .Values.router.drainTimeoutSeconds "reload_poll_s" .Values.router.reloadPollSeconds -}}
{{- $cfg := dict "server" $server -}}
{{- if .Values.discovery.enabled -}}
{{- $k8s := dict "enabled" true "label_selector" (include "kvroute.engineSelector" .) "port" (int .Values.discovery.enginePort) "role_label" .Values.discovery.roleLabel -}}
{{- if .Values.discovery.namespace -}}{{- $_ := set $k8s "namespace" .Values.discovery.namespace -}}{{- end -}}
{{- if .Values.discovery.kvEventsPort -}}{{- $_ := set $k8s "kv_events_port" (int .Values.discovery.kvEventsPort) -}}{{- end -}}
{{- if .Values.discovery.kvEventsReplayPort -}}{{- $_ := set $k8s "kv_events_replay_port" (int .Values.discovery.kvEventsReplayPort) -}}{{- end -}}
{{- $_ := set $k8s "node_topology" (.Values.discovery.nodeTopology | default false) -}}
{{- if .Values.discovery.rackLabel -}}{{- $_ := set $k8s "rack_label" .Values.discovery.rackLabel -}}{{- end -}}
{{- $_ := set $cfg "discovery" (dict "kubernetes" $k8s) -}}
{{- end -}}
{{- if .Values.engines -}}{{- $_ := set $cfg "engines" .Values.engines -}}{{- end -}}
{{- $redis := include "kvroute.redisUrl" . -}}
{{- if $redis -}}
{{- $index := dict "backend" "redis" -}}
{{- /* router.config's own index.url (the key's deprecated name) still wins over the chart's */ -}}
{{- $own := get (.Values.router.config | default dict) "index" | default dict -}}
{{- if not (hasKey $own "url") -}}{{- $_ := set $index "redis" (dict "url" $redis) -}}{{- end -}}
{{- $_ := set $cfg "index" $index -}}
{{- end -}}
{{- $merged := mustMergeOverwrite $cfg (deepCopy .Values.router.config) -}}
{{- toYaml $merged -}}
{{- end -}}
