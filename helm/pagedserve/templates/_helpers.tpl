{{/* Names: <release>-pagedserve unless overridden. The chart name is cut to the 63 characters
     of a label; the full name to 45, so that every object named after it fits Kubernetes'
     limits: <fullname>-workers (a Service, 63 at most), and above all <fullname>-worker, a
     StatefulSet, whose name its pods carry in a controller-revision-hash label with 11 more
     characters (so 52 at most, or no pod is ever made). */}}
{{- define "pagedserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pagedserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "pagedserve.name" .) | trunc 45 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pagedserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "pagedserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The labels that select one component's pods; call with (list $ "router") or (list $ "worker"). */}}
{{- define "pagedserve.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "pagedserve.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* The image of a component: (list $ .Values.router.image); the tag defaults to the appVersion. */}}
{{- define "pagedserve.image" -}}
{{- $root := index . 0 -}}
{{- $image := index . 1 -}}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) -}}
{{- end -}}

{{/* The workers' headless Service, and the name the routers resolve to find every ready worker. */}}
{{- define "pagedserve.workersService" -}}
{{- printf "%s-workers" (include "pagedserve.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pagedserve.workersTarget" -}}
{{- if eq .Values.router.discoveryMode "kubernetes" -}}
{{- printf "k8s:%s.%s:%v" (include "pagedserve.workersService" .) .Release.Namespace .Values.worker.port -}}
{{- else -}}
{{- printf "dns:%s.%s.svc.%s:%v" (include "pagedserve.workersService" .) .Release.Namespace .Values.clusterDomain .Values.worker.port -}}
{{- end -}}
{{- end -}}

{{/* The routers' service account: the one given, else with discoveryMode kubernetes the
     chart's (which the Role is bound to), else none (the namespace's default). */}}
{{- define "pagedserve.routerServiceAccount" -}}
{{- if .Values.router.serviceAccountName -}}
{{- .Values.router.serviceAccountName -}}
{{- else if eq .Values.router.discoveryMode "kubernetes" -}}
{{- printf "%s-router" (include "pagedserve.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* TLS between routers and workers: where tls.secretName is mounted in both, and the name
     the workers' certificate must carry. */}}
{{- define "pagedserve.tlsDir" -}}
/etc/pagedserve/tls
{{- end -}}

{{- define "pagedserve.tlsServerName" -}}
{{- default (printf "%s.%s.svc" (include "pagedserve.workersService" .) .Release.Namespace) .Values.tls.serverName -}}
{{- end -}}

{{- define "pagedserve.tlsVolume" -}}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
    defaultMode: 0440        # read by the owner and the pod's fsGroup, the images' group
{{- end -}}

{{- define "pagedserve.tlsVolumeMount" -}}
- name: tls
  mountPath: {{ include "pagedserve.tlsDir" . }}
  readOnly: true
{{- end -}}

{{/* The Secret holding the API key, when there is one. */}}
{{- define "pagedserve.apiKeySecret" -}}
{{- if .Values.router.apiKey.existingSecret -}}
{{- .Values.router.apiKey.existingSecret -}}
{{- else if .Values.router.apiKey.value -}}
{{- printf "%s-api-key" (include "pagedserve.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* Grace periods: what stopping takes (see values.yaml), so that Kubernetes never kills a
     pod in the middle of it. A worker hands its requests back within 5 s of SIGTERM
     (worker/server.py); a router sleeps, then gives running requests shutdownGrace. */}}
{{- define "pagedserve.workerGracePeriod" -}}
{{- add 5 .Values.worker.terminationMarginSeconds -}}
{{- end -}}

{{- define "pagedserve.routerGracePeriod" -}}
{{- add .Values.router.preStopSleepSeconds (ceil .Values.router.shutdownGrace) 10 -}}
{{- end -}}

{{/* Environment both components share: the pod's identity and the OpenTelemetry settings.
     Call with (list $ "pagedserve-router"). */}}
{{- define "pagedserve.commonEnv" -}}
{{- $root := index . 0 -}}
{{- $otel := $root.Values.otel -}}
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: POD_NAMESPACE
  valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
- name: POD_UID
  valueFrom: {fieldRef: {fieldPath: metadata.uid}}
- name: NODE_NAME
  valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
- name: OTEL_SERVICE_NAME
  value: {{ index . 1 }}
- name: OTEL_RESOURCE_ATTRIBUTES
  {{- $attributes := list "k8s.pod.name=$(POD_NAME)" "k8s.pod.uid=$(POD_UID)" "k8s.namespace.name=$(POD_NAMESPACE)" "k8s.node.name=$(NODE_NAME)" "service.instance.id=$(POD_NAME)" }}
  {{- range $key, $value := $otel.resourceAttributes }}
  {{- $attributes = append $attributes (printf "%s=%v" $key $value) }}
  {{- end }}
  value: {{ join "," $attributes | quote }}
{{- with $otel.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
{{- end }}
{{- with $otel.sampler }}
- name: OTEL_TRACES_SAMPLER
  value: {{ . | quote }}
{{- end }}
{{- with $otel.samplerArg }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ . | quote }}
{{- end }}
{{- end -}}

{{/* topologySpreadConstraints with the component's pods as labelSelector where none is given:
     (list $ "worker" .Values.worker.topologySpreadConstraints). */}}
{{- define "pagedserve.topologySpread" -}}
{{- $root := index . 0 -}}
{{- $constraints := list -}}
{{- range index . 2 -}}
{{- $constraint := deepCopy . -}}
{{- if not (hasKey $constraint "labelSelector") -}}
{{- $_ := set $constraint "labelSelector" (dict "matchLabels" (include "pagedserve.selectorLabels" (list $root (index $ 1)) | fromYaml)) -}}
{{- end -}}
{{- $constraints = append $constraints $constraint -}}
{{- end -}}
{{- toYaml $constraints -}}
{{- end -}}
