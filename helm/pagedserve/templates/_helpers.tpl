{{- define "pagedserve.name" -}}{{ .Release.Name }}-pagedserve{{- end -}}
{{- define "pagedserve.labels" -}}
app.kubernetes.io/name: pagedserve
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}
