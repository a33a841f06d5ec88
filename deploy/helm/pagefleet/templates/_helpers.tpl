{{/* Names, labels and small shared pieces of the pagefleet chart. */}}

{{- define "pagefleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* <release>-<chart>, or <release> when it already holds the chart name; 52 characters leave
room for the "-operator", "-models" and "-dashboard" suffixes within 63. */}}
{{- define "pagefleet.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pagefleet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pagefleet.labels" -}}
helm.sh/chart: {{ include "pagefleet.chart" . }}
{{ include "pagefleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pagefleet
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "pagefleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pagefleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pagefleet.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "pagefleet.gpuImage" -}}
{{- printf "%s:%s" .Values.image.repository (default (printf "%s-cuda" .Chart.AppVersion) .Values.image.cudaTag) -}}
{{- end -}}

{{- define "pagefleet.routerImage" -}}
{{- printf "%s:%s" .Values.routerImage.repository (default .Chart.AppVersion .Values.routerImage.tag) -}}
{{- end -}}

{{- define "pagefleet.operatorImage" -}}
{{- printf "%s:%s" .Values.operatorImage.repository (default .Chart.AppVersion .Values.operatorImage.tag) -}}
{{- end -}}

{{- define "pagefleet.operator.fullname" -}}
{{- printf "%s-operator" (include "pagefleet.fullname" .) -}}
{{- end -}}

{{- define "pagefleet.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create -}}
{{- default (include "pagefleet.operator.fullname" .) .Values.operator.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.operator.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The namespaces the operator watches when scope is "namespace" (a YAML list). */}}
{{- define "pagefleet.common.namespaces" -}}
{{- toYaml (default (list .Release.Namespace) .Values.operator.watchNamespaces | uniq) -}}
{{- end -}}

{{- define "pagefleet.modelCache.claimName" -}}
{{- printf "%s-models" (include "pagefleet.fullname" .) -}}
{{- end -}}

{{- define "pagefleet.modelDeployment.name" -}}
{{- default .Values.modelDeployment.model.name .Values.modelDeployment.name -}}
{{- end -}}

{{/* The pools the chosen mode takes (values hold all three so that switching mode needs no
nulling of the other pools). */}}
{{- define "pagefleet.modelDeployment.poolNames" -}}
{{- if eq .Values.modelDeployment.mode "disaggregated" -}}
{{- toYaml (list "prefill" "decode") -}}
{{- else -}}
{{- toYaml (list "colocated") -}}
{{- end -}}
{{- end -}}

{{/* Security contexts: values for every pod and container the chart renders. */}}
{{- define "pagefleet.podSecurityContext" -}}
{{- toYaml .Values.podSecurityContext -}}
{{- end -}}

{{- define "pagefleet.containerSecurityContext" -}}
{{- toYaml .Values.containerSecurityContext -}}
{{- end -}}

{{/* The operator's pods as a NetworkPolicyPeer (from any namespace's policy). */}}
{{- define "pagefleet.operator.peer" -}}
{{- $labels := include "pagefleet.selectorLabels" . | fromYaml -}}
{{- $_ := set $labels "app.kubernetes.io/component" "operator" -}}
{{- toJson (dict "namespaceSelector" (dict "matchLabels" (dict "kubernetes.io/metadata.name" .Release.Namespace)) "podSelector" (dict "matchLabels" $labels)) -}}
{{- end -}}

{{/* --network-policy-peers: the peers outside a ModelDeployment its NetworkPolicies name. */}}
{{- define "pagefleet.networkPolicy.peers" -}}
{{- $np := .Values.networkPolicy -}}
{{- $peers := dict "operatorFrom" (list (include "pagefleet.operator.peer" . | fromJson)) "metricsFrom" $np.metricsFrom "clientsFrom" $np.clientsFrom "apiServer" $np.apiServer "dns" $np.dns -}}
{{- /* Empty: the operator's default, any Gateway's proxy pods (never "anyone"). */ -}}
{{- with $np.gatewayFrom }}{{ $_ := set $peers "gatewayFrom" . }}{{ end -}}
{{- toJson $peers -}}
{{- end -}}

{{/* NetworkPolicy egress rules for DNS and the API server (empty `to`: any address). */}}
{{- define "pagefleet.networkPolicy.infrastructure" -}}
{{- $np := .Values.networkPolicy -}}
- ports:
    - {port: 53, protocol: TCP}
    - {port: 53, protocol: UDP}
  {{- with $np.dns.to }}
  to:
    {{- toYaml . | nindent 4 }}
  {{- end }}
- ports:
    {{- range $np.apiServer.ports }}
    - {port: {{ . }}, protocol: TCP}
    {{- end }}
  {{- with $np.apiServer.to }}
  to:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}
