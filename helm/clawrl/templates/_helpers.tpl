{{/* The chart name, or nameOverride. */}}
{{- define "clawrl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The prefix of every object's name: the release name (with the chart name when it is not already in it), or fullnameOverride. */}}
{{- define "clawrl.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "clawrl.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "clawrl.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* A component's object name, e.g. clawrl-gateway. Call with (dict "root" $ "component" "gateway"). */}}
{{- define "clawrl.componentName" -}}
{{- printf "%s-%s" (include "clawrl.fullname" .root) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The labels selecting a component's pods (stable across upgrades). */}}
{{- define "clawrl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "clawrl.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* The standard app.kubernetes.io labels of every object of a component. */}}
{{- define "clawrl.labels" -}}
{{ include "clawrl.selectorLabels" . }}
app.kubernetes.io/part-of: clawrl
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end }}

{{/* A component's image: <registry>/<name>:<tag>, the tag defaulting to image.tag, then appVersion; with image.digest set, <registry>/<name>@<digest> (pinned: a moved tag cannot change what runs). Call with (dict "root" $ "image" .Values.gateway.image). */}}
{{- define "clawrl.image" -}}
{{- $tag := .image.tag | default .root.Values.image.tag | default .root.Chart.AppVersion }}
{{- $name := .image.name }}
{{- if .root.Values.image.registry }}
{{- $name = printf "%s/%s" .root.Values.image.registry .image.name }}
{{- end }}
{{- if .image.digest }}
{{- printf "%s@%s" $name .image.digest }}
{{- else }}
{{- printf "%s:%s" $name $tag }}
{{- end }}
{{- end }}

{{/* The Redis URL every service uses: the in-chart StatefulSet, or redis.externalUrl. */}}
{{- define "clawrl.redisUrl" -}}
{{- if and .Values.redis.cluster (eq .Values.redis.mode "internal") }}
{{- fail "redis.cluster: the internal Redis is a single node; set redis.mode external and redis.externalUrl to any node of your Redis Cluster (redis.streamShards alone shards the streams on the internal Redis)" }}
{{- end }}
{{- if eq .Values.redis.mode "internal" }}
{{- /* With auth, Kubernetes puts the password in from REDIS_PASSWORD (clawrl.redisPasswordEnv, listed before it). */}}
{{- $auth := ternary ":$(REDIS_PASSWORD)@" "" (not (empty .Values.redis.auth.existingSecret)) }}
{{- printf "redis://%s%s:6379/0" $auth (include "clawrl.componentName" (dict "root" . "component" "redis")) }}
{{- else }}
{{- required "redis.externalUrl is required when redis.mode is external" .Values.redis.externalUrl }}
{{- end }}
{{- end }}

{{/* The env var REDIS_PASSWORD from redis.auth's Secret (nothing without one), named by the internal Redis URL (an external one may name it too: redis://:$(REDIS_PASSWORD)@host) and by redis-server's --requirepass. */}}
{{- define "clawrl.redisPasswordEnv" -}}
{{- with .Values.redis.auth.existingSecret }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.redis.auth.key }}
{{- end }}
{{- end }}

{{/* clawrl settings as environment variables CLAWRL_<SECTION>__<FIELD>: the shared ones (logging; redis.url with "redis" true), then the component's computed ones, then the component's `settings` value on top; then the component's raw `env` list. Call with (dict "root" $ "settings" (dict "model" (dict "path" "/models/x")) "values" .Values.gateway "redis" true). */}}
{{- define "clawrl.env" -}}
{{- $shared := dict "logging" (dict "level" .root.Values.logLevel "format" "json") }}
{{- if .redis }}
{{- $redis := dict "url" (include "clawrl.redisUrl" .root) }}
{{- /* Sharding changes every stream and state key's name: all services get the same two settings (the defaults, one Redis and one shard, are left to the services). */}}
{{- if or .root.Values.redis.cluster (gt (int .root.Values.redis.streamShards) 1) }}
{{- $_ := set $redis "cluster" .root.Values.redis.cluster }}
{{- $_ := set $redis "stream_shards" (int .root.Values.redis.streamShards) }}
{{- end }}
{{- $_ := set $shared "redis" $redis }}
{{- end }}
{{- $all := mustMergeOverwrite $shared (deepCopy (.settings | default dict)) (deepCopy (.values.settings | default dict)) }}
{{- if .redis }}
{{- include "clawrl.redisPasswordEnv" .root }}
{{- end }}
{{- range $section := keys $all | sortAlpha }}
{{- $fields := get $all $section }}
{{- range $field := keys $fields | sortAlpha }}
{{- $value := get $fields $field }}
- name: {{ printf "CLAWRL_%s__%s" $section $field | upper }}
  value: {{ if kindIs "string" $value }}{{ $value | quote }}{{ else }}{{ $value | toJson | quote }}{{ end }}
{{- end }}
{{- end }}
{{- with .values.env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The clawrl settings section `tenants` (YAML) the gateway and the trainer share, from the tenants values; with mode per_tenant, what it needs is checked first (the trainer would refuse to start, the engine could not serve adapters). Call with the root context. */}}
{{- define "clawrl.tenantSettings" -}}
{{- $t := .Values.tenants }}
{{- if eq $t.mode "per_tenant" }}
{{- if not .Values.policyEngine.lora.enabled }}
{{- fail "tenants.mode per_tenant serves each tenant a LoRA adapter: set policyEngine.lora.enabled" }}
{{- end }}
{{- if and .Values.trainer.enabled (or (ne .Values.trainer.backend "torch") (not (dig "lora" "enabled" false (.Values.trainer.settings | default dict)))) }}
{{- fail "tenants.mode per_tenant trains one LoRA adapter per tenant: set trainer.backend torch and trainer.settings.lora.enabled true" }}
{{- end }}
{{- end }}
{{- $tenants := dict "mode" $t.mode "max_adapters" (int $t.maxAdapters) "min_samples_per_step" (int $t.minSamplesPerStep) "allow" $t.allow }}
{{- with $t.pattern }}{{ $_ := set $tenants "pattern" . }}{{ end }}
{{- with $t.header }}{{ $_ := set $tenants "header" . }}{{ end }}
{{- toYaml (dict "tenants" $tenants) }}
{{- end }}

{{/* Placement of a GPU pod: node selector, tolerations and runtime class its own when set, else the shared gpuNode ones (the nvidia.com/gpu request alone already picks GPU nodes); then its priority class, affinity and topology spread. */}}
{{- define "clawrl.gpuPlacement" -}}
{{- with (.values.nodeSelector | default .root.Values.gpuNode.nodeSelector) }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with (.values.tolerations | default .root.Values.gpuNode.tolerations) }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- include "clawrl.podScheduling" (dict "values" .values "runtimeClassName" (.values.runtimeClassName | default .root.Values.gpuNode.runtimeClassName)) }}
{{- end }}

{{/* Placement of a CPU pod: node selector, tolerations, runtime and priority class, affinity and topology spread (its own values only). */}}
{{- define "clawrl.cpuPlacement" -}}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- include "clawrl.podScheduling" (dict "values" .values "runtimeClassName" .values.runtimeClassName) }}
{{- end }}

{{/* A pod's runtime class, priority class, affinity and topology spread constraints from its component's values (each only when set). Call with (dict "values" .Values.gateway "runtimeClassName" "nvidia"). */}}
{{- define "clawrl.podScheduling" -}}
{{- with .runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* A pod template's annotations: the chart's own (a dict, e.g. checksums) and the component's podAnnotations on top; nothing when both are empty. Call with (dict "values" .Values.gateway "annotations" (dict "checksum/x" "...")). */}}
{{- define "clawrl.podAnnotations" -}}
{{- $all := mustMerge (deepCopy (.values.podAnnotations | default dict)) (.annotations | default dict) }}
{{- with $all }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Pod-level settings every pod shares: pull secrets and the non-root security context. */}}
{{- define "clawrl.podDefaults" -}}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The emptyDir volumes behind the writable directories of a pod whose root filesystem is read-only (securityContext.readOnlyRootFilesystem): /tmp, and with "home" true $HOME, where SGLang, Triton, FlashInfer, torch and CUDA keep their JIT and compile caches. Call with (dict "home" true), or (dict) for /tmp only. */}}
{{- define "clawrl.scratchVolumes" -}}
- name: tmp
  emptyDir: {}
{{- if .home }}
- name: home
  emptyDir: {}
{{- end }}
{{- end }}

{{/* A container's mounts of clawrl.scratchVolumes: /tmp, and with "home" true /home/clawrl (the container must set HOME to it: the CPU engine's image has another home). Call as clawrl.scratchVolumes. */}}
{{- define "clawrl.scratchMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if .home }}
- name: home
  mountPath: /home/clawrl
{{- end }}
{{- end }}

{{/* Container resources; with gpus > 0, nvidia.com/gpu is added to requests and limits. Call with (dict "resources" .resources "gpus" 2). */}}
{{- define "clawrl.resources" -}}
{{- $res := deepCopy (.resources | default dict) }}
{{- if gt (int (.gpus | default 0)) 0 }}
{{- $_ := set $res "limits" (mustMergeOverwrite (get $res "limits" | default dict) (dict "nvidia.com/gpu" (int .gpus))) }}
{{- $_ := set $res "requests" (mustMergeOverwrite (get $res "requests" | default dict) (dict "nvidia.com/gpu" (int .gpus))) }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{/* An init container that downloads a Hugging Face model into the model cache volume unless it is there already (the weights for engines and the trainer, only tokenizer/config files for the gateway and the judge). Call with (dict "root" $ "model" .Values.models.policy "image" <image> "tokenizerOnly" true "name" "fetch-policy-model"). */}}
{{- define "clawrl.modelFetch" -}}
{{- if .model.hubId }}
- name: {{ .name | default "fetch-model" }}
  image: {{ .image }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  command: ["python", "-c"]
  args:
    - |
      import os, sys
      from huggingface_hub import snapshot_download
      target = os.path.join("/models", sys.argv[1])
      patterns = ["*.json", "*.jinja", "*.model", "*.txt"] if sys.argv[3] == "true" else None
      snapshot_download(sys.argv[2], local_dir=target, allow_patterns=patterns)
    - {{ .model.name | quote }}
    - {{ .model.hubId | quote }}
    - {{ .tokenizerOnly | default false | quote }}
  env:
    - name: HF_HOME
      value: /models/.hf-home
    {{- if .root.Values.models.hfTokenSecret }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ .root.Values.models.hfTokenSecret }}
          key: HF_TOKEN
    {{- end }}
  securityContext:
    {{- toYaml .root.Values.securityContext | nindent 4 }}
  resources:
    {{- toYaml .root.Values.models.fetchResources | nindent 4 }}
  volumeMounts:
    - name: models
      mountPath: /models
    {{- include "clawrl.scratchMounts" (dict) | nindent 4 }}
{{- end }}
{{- end }}

{{/* The model cache volume (a PVC shared by every pod that reads a model). */}}
{{- define "clawrl.modelsVolume" -}}
- name: models
  persistentVolumeClaim:
    claimName: {{ .Values.volumes.models.existingClaim | default (include "clawrl.componentName" (dict "root" . "component" "models")) }}
{{- end }}

{{/* The shared checkpoint volume (trainer writes vN, engines read it). */}}
{{- define "clawrl.checkpointsVolume" -}}
- name: checkpoints
  persistentVolumeClaim:
    claimName: {{ .Values.volumes.checkpoints.existingClaim | default (include "clawrl.componentName" (dict "root" . "component" "checkpoints")) }}
{{- end }}

{{/* An engine (policy or judge): a Deployment running `clawrl-engine --backend sglang`, which execs SGLang's launcher (or the CPU engine with backend cpu); with values.lora.enabled its LoRA settings become the engine's (SGLang's LoRA flags). Call with (dict "root" $ "component" "policy-engine" "values" .Values.policyEngine "model" .Values.models.policy "checkpoints" true). */}}
{{- define "clawrl.engineDeployment" -}}
{{- $root := .root }}
{{- $v := .values }}
{{- $image := include "clawrl.image" (dict "root" $root "image" $v.image) }}
{{- $settings := dict
  "model" (dict "path" (printf "/models/%s" .model.name))
  "engine" (dict "host" "0.0.0.0" "port" 30000 "backend" $v.backend)
  "sglang" (dict "tp_size" $v.tensorParallel "enable_metrics" true) }}
{{- if and $v.lora $v.lora.enabled }}
{{- $_ := mergeOverwrite (get $settings "engine") (dict "enable_lora" true "max_lora_rank" $v.lora.maxRank "lora_target_modules" $v.lora.targetModules "max_loras_per_batch" $v.lora.maxLorasPerBatch) }}
{{- /* Per tenant, one adapter per tenant and the shared one, and during a sync the new version of one beside the old. */}}
{{- $loaded := $v.lora.maxLoadedLoras }}
{{- $t := $root.Values.tenants }}
{{- $perTenant := eq $t.mode "per_tenant" }}
{{- /* An allow-list alone names every tenant that can own an adapter. */}}
{{- $owners := ternary (min (len $t.allow) $t.maxAdapters) $t.maxAdapters (and (gt (len $t.allow) 0) (not $t.pattern)) }}
{{- if and (not $loaded) $perTenant }}
{{- $loaded = max (mul 2 (add 1 $owners)) $v.lora.maxLorasPerBatch }}
{{- end }}
{{- if $loaded }}
{{- if lt (int $loaded) (int $v.lora.maxLorasPerBatch) }}
{{- fail (printf "policyEngine.lora.maxLoadedLoras (%d) must be at least maxLorasPerBatch (%d), as SGLang requires" (int $loaded) (int $v.lora.maxLorasPerBatch)) }}
{{- end }}
{{- /* Fewer slots than served adapters: the engine unloads one the launcher reloads, for ever. */}}
{{- if and $perTenant (lt (int $loaded) (int (add 2 $owners))) }}
{{- fail (printf "policyEngine.lora.maxLoadedLoras (%d) must be at least %d in per_tenant mode: %d tenants' adapters, the shared one, and a new version during a sync (or leave it null)" (int $loaded) (int (add 2 $owners)) (int $owners)) }}
{{- end }}
{{- $_ := set (get $settings "engine") "max_loaded_loras" (int $loaded) }}
{{- end }}
{{- end }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "clawrl.componentName" . }}
  labels:
    {{- include "clawrl.labels" . | nindent 4 }}
spec:
  replicas: {{ $v.replicas }}
  # A new pod needs the GPUs an old one holds: never surge. With several replicas one at a time
  # is replaced, so serving stays up through the new one's weight load; a single one is recreated.
  strategy:
    {{- if gt (int $v.replicas) 1 }}
    type: RollingUpdate
    rollingUpdate:
      maxSurge: 0
      maxUnavailable: 1
    {{- else }}
    type: Recreate
    {{- end }}
  selector:
    matchLabels:
      {{- include "clawrl.selectorLabels" . | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "clawrl.labels" . | nindent 8 }}
      {{- with include "clawrl.podAnnotations" (dict "values" $v) | trim }}
      {{- . | nindent 6 }}
      {{- end }}
    spec:
      # SGLang never talks to the Kubernetes API.
      automountServiceAccountToken: false
      {{- include "clawrl.podDefaults" $root | nindent 6 }}
      {{- with include "clawrl.gpuPlacement" (dict "root" $root "values" $v) | trim }}
      {{- . | nindent 6 }}
      {{- end }}
      {{- with (include "clawrl.modelFetch" (dict "root" $root "model" .model "image" $image "tokenizerOnly" false) | trim) }}
      initContainers:
        {{- . | nindent 8 }}
      {{- end }}
      containers:
        - name: engine
          image: {{ $image }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          # The image's default flags differ by target; these match the settings below.
          args: [--host, 0.0.0.0, --port, "30000", --backend, {{ $v.backend }}]
          ports:
            - name: http
              containerPort: 30000
          env:
            - name: HF_HOME
              value: /models/.hf-home
            - name: HOME
              value: /home/clawrl
            {{- include "clawrl.env" (dict "root" $root "settings" $settings "values" $v) | trim | nindent 12 }}
          # Loading (and compiling) a large model takes minutes: the startup probe allows it,
          # and only after it passes do the other probes start.
          startupProbe:
            httpGet:
              path: /health
              port: http
            periodSeconds: 10
            timeoutSeconds: 5
            failureThreshold: {{ $v.startupFailureThreshold }}
          # Liveness is a TCP connect: an HTTP check that queues behind a weight update or a long
          # batch would restart a healthy engine mid-load.
          livenessProbe:
            tcpSocket:
              port: http
            periodSeconds: 20
            failureThreshold: 6
          readinessProbe:
            httpGet:
              path: /health
              port: http
            periodSeconds: 10
            timeoutSeconds: 5
            failureThreshold: 3
          resources:
            {{- include "clawrl.resources" (dict "resources" $v.resources "gpus" $v.gpus) | nindent 12 }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          volumeMounts:
            - name: models
              mountPath: /models
            - name: dshm
              mountPath: /dev/shm
            {{- include "clawrl.scratchMounts" (dict "home" true) | nindent 12 }}
            {{- if .checkpoints }}
            # New policy versions arrive here (/update_weights_from_disk reads them).
            - name: checkpoints
              mountPath: /checkpoints
              readOnly: true
            {{- end }}
      volumes:
        {{- include "clawrl.modelsVolume" $root | nindent 8 }}
        {{- if .checkpoints }}
        {{- include "clawrl.checkpointsVolume" $root | nindent 8 }}
        {{- end }}
        # NCCL between tensor-parallel ranks needs far more shared memory than the 64 MiB default.
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $v.shmSize }}
        {{- include "clawrl.scratchVolumes" (dict "home" true) | nindent 8 }}
{{- end }}

{{/* The ClusterIP Service of an engine (SGLang API and /metrics on port 30000), and with "replicas" true a headless one that resolves to every replica (the weight sync loads each). */}}
{{- define "clawrl.engineService" -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "clawrl.componentName" . }}
  labels:
    {{- include "clawrl.labels" . | nindent 4 }}
spec:
  type: ClusterIP
  selector:
    {{- include "clawrl.selectorLabels" . | nindent 4 }}
  ports:
    - name: http
      port: 30000
      targetPort: http
{{- if .replicas }}
---
apiVersion: v1
kind: Service
metadata:
  name: {{ include "clawrl.componentName" . }}-replicas
  labels:
    {{- include "clawrl.labels" . | nindent 4 }}
    # Its ServiceMonitor skips it: the same pods behind the ClusterIP Service are scraped once.
    clawrl.io/headless: "true"
spec:
  clusterIP: None
  # A replica still loading weights must get the new version too.
  publishNotReadyAddresses: true
  selector:
    {{- include "clawrl.selectorLabels" . | nindent 4 }}
  ports:
    - name: http
      port: 30000
      targetPort: http
{{- end }}
{{- end }}

{{/* A ServiceMonitor scraping /metrics of a component's Service port(s). Call with (dict "root" $ "component" "gateway" "port" "http"), or "ports" (list ...) for several. */}}
{{- define "clawrl.serviceMonitor" -}}
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata:
  name: {{ include "clawrl.componentName" . }}
  labels:
    {{- include "clawrl.labels" . | nindent 4 }}
    {{- with .root.Values.serviceMonitor.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  selector:
    matchLabels:
      {{- include "clawrl.selectorLabels" . | nindent 6 }}
    # Not the headless per-replica Service (same pods: every series would be scraped twice).
    matchExpressions:
      - key: clawrl.io/headless
        operator: DoesNotExist
  endpoints:
    {{- range (.ports | default (list .port)) }}
    - port: {{ . }}
      path: /metrics
      interval: {{ $.root.Values.serviceMonitor.interval }}
      scrapeTimeout: {{ $.root.Values.serviceMonitor.scrapeTimeout }}
    {{- end }}
{{- end }}

{{/* A NetworkPolicy peer matching every pod of this release. */}}
{{- define "clawrl.releasePods" -}}
- podSelector:
    matchLabels:
      app.kubernetes.io/name: {{ include "clawrl.name" . }}
      app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* A NetworkPolicy admitting only this release's pods (and the scrapers on the metrics port) to a component. Call with (dict "root" $ "component" "redis" "ports" (list 6379) "metricsPorts" (list 30000)); metricsPorts may be omitted, "from" (a NetworkPolicyPeer list) narrows the release's pods to those peers, and "extraIngress" (a list of NetworkPolicyIngressRules) adds rules. */}}
{{- define "clawrl.internalNetworkPolicy" -}}
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: {{ include "clawrl.componentName" . }}
  labels:
    {{- include "clawrl.labels" . | nindent 4 }}
spec:
  podSelector:
    matchLabels:
      {{- include "clawrl.selectorLabels" . | nindent 6 }}
  policyTypes: [Ingress]
  ingress:
    - from:
        {{- if .from }}
        {{- toYaml .from | nindent 8 }}
        {{- else }}
        {{- include "clawrl.releasePods" .root | nindent 8 }}
        {{- end }}
      {{- with .ports }}
      ports:
        {{- range . }}
        - port: {{ . }}
        {{- end }}
      {{- end }}
    {{- if and .metricsPorts .root.Values.networkPolicy.scrapeFrom }}
    - from:
        {{- toYaml .root.Values.networkPolicy.scrapeFrom | nindent 8 }}
      ports:
        {{- range .metricsPorts }}
        - port: {{ . }}
        {{- end }}
    {{- end }}
    {{- with .extraIngress }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{/* "true" when the trainer's head runs the weight-sync launcher (weightSync enabled, transport disk; with nccl the trainer syncs itself), else "false". Call with the root context. */}}
{{- define "clawrl.weightSyncLauncher" -}}
{{- and .Values.weightSync.enabled (eq .Values.weightSync.transport "disk") }}
{{- end }}

{{/* Where a weight sync finds every gateway replica (GatewayControl on 30001 of the headless control Service) and every policy engine replica (30000 of the headless -replicas Service), as clawrl settings sections gateways and engines (YAML): the weight-sync Job's, and the trainer's with weightSync.transport nccl. Call with the root context. */}}
{{- define "clawrl.syncTargets" -}}
gateways:
  service: {{ printf "%s-control.%s.svc" (include "clawrl.componentName" (dict "root" . "component" "gateway")) .Release.Namespace }}
  port: 30001
engines:
  service: {{ printf "%s-replicas.%s.svc" (include "clawrl.componentName" (dict "root" . "component" "policy-engine")) .Release.Namespace }}
  port: 30000
{{- end }}

{{/* CLAWRL_GATEWAYS__TOKEN from gateway.controlTokenSecret (nothing without one): the bearer token a weight sync sends to GatewayControl. Call with the root context. */}}
{{- define "clawrl.controlTokenEnv" -}}
{{- with .Values.gateway.controlTokenSecret }}
- name: CLAWRL_GATEWAYS__TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: token
{{- end }}
{{- end }}

{{/* The weight-sync Job's spec: pause every gateway replica, load a policy version into every policy engine, resume. The launcher instantiates it per version (ConfigMap <release>-weight-sync; it adds `run --version N --path P`); the suspended CronJob carries the same spec with `run` (the newest announced version). Call with (dict "root" $ "args" (list "run")); args may be omitted. */}}
{{- define "clawrl.weightSyncJobSpec" -}}
{{- $args := .args }}
{{- with .root }}
{{- $ctx := dict "root" . "component" "weight-sync" }}
{{- $v := .Values.weightSync }}
{{- $settings := include "clawrl.syncTargets" . | fromYaml }}
backoffLimit: {{ $v.backoffLimit }}
activeDeadlineSeconds: {{ $v.activeDeadlineSeconds }}
ttlSecondsAfterFinished: {{ $v.ttlSecondsAfterFinished }}
template:
  metadata:
    labels:
      {{- include "clawrl.labels" $ctx | nindent 6 }}
    {{- with include "clawrl.podAnnotations" (dict "values" $v) | trim }}
    {{- . | nindent 4 }}
    {{- end }}
  spec:
    restartPolicy: Never
    # It talks to the gateway and the engine only; no Kubernetes API access.
    automountServiceAccountToken: false
    {{- include "clawrl.podDefaults" . | nindent 4 }}
    {{- with include "clawrl.cpuPlacement" (dict "root" . "values" $v) | trim }}
    {{- . | nindent 4 }}
    {{- end }}
    containers:
      - name: weight-sync
        image: {{ include "clawrl.image" (dict "root" . "image" $v.image) }}
        imagePullPolicy: {{ .Values.image.pullPolicy }}
        command: [clawrl-weight-sync]
        {{- with $args }}
        args: {{ toJson . }}
        {{- end }}
        env:
          {{- include "clawrl.env" (dict "root" . "settings" $settings "values" $v "redis" true) | trim | nindent 10 }}
          {{- with include "clawrl.controlTokenEnv" . | trim }}
          {{- . | nindent 10 }}
          {{- end }}
        resources:
          {{- toYaml $v.resources | nindent 10 }}
        securityContext:
          {{- toYaml .Values.securityContext | nindent 10 }}
        volumeMounts:
          {{- include "clawrl.scratchMounts" (dict) | nindent 10 }}
    volumes:
      {{- include "clawrl.scratchVolumes" (dict) | nindent 6 }}
{{- end }}
{{- end }}

{{/* The labels of the sandbox pods (agent-sandbox starts them from the SandboxTemplate): their own app.kubernetes.io/name, so no NetworkPolicy admitting "the release's pods" (clawrl.releasePods: Redis, the sandbox service) ever admits a sandbox. Call with the root context. */}}
{{- define "clawrl.sandboxPodLabels" -}}
app.kubernetes.io/name: {{ printf "%s-sandbox" (include "clawrl.name" .) }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: sandbox
app.kubernetes.io/part-of: clawrl
{{- end }}

{{/* The sandbox service's lease API URL inside the cluster (the agent runner's --environments-url). Call with the root context. */}}
{{- define "clawrl.environmentsUrl" -}}
{{- printf "http://%s:%d" (include "clawrl.componentName" (dict "root" . "component" "environments")) (int .Values.environments.port) }}
{{- end }}

{{/* CLAWRL_ENVIRONMENTS_SERVER__TOKEN from environments.tokenSecret (nothing without one): the lease API's bearer token, which the sandbox service requires and the agent runner sends (both read that variable). Call with the root context. */}}
{{- define "clawrl.environmentsTokenEnv" -}}
{{- with .Values.environments.tokenSecret }}
- name: CLAWRL_ENVIRONMENTS_SERVER__TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: token
{{- end }}
{{- end }}

{{/* "true" when a component's `env` list (Kubernetes EnvVar list) names one of `names`, else "". Call with (dict "env" .Values.environments.env "names" (list "A" "B")). */}}
{{- define "clawrl.envNames" -}}
{{- $found := false }}
{{- range (.env | default list) }}
{{- if has .name $.names }}{{ $found = true }}{{ end }}
{{- end }}
{{- if $found }}true{{ end }}
{{- end }}

{{/* Where a bearer token of the sandbox service's lease API is set other than by environments.tokenSecret: its settings (environments_server.token or token_file) or its env list; "" when nowhere. Call with the root context. */}}
{{- define "clawrl.environmentsOwnToken" -}}
{{- $v := .Values.environments }}
{{- $server := dig "environments_server" dict ($v.settings | default dict) }}
{{- if or (get $server "token") (get $server "token_file") }}environments.settings.environments_server
{{- else if include "clawrl.envNames" (dict "env" $v.env "names" (list "CLAWRL_ENVIRONMENTS_SERVER__TOKEN" "CLAWRL_ENVIRONMENTS_SERVER__TOKEN_FILE")) }}environments.env
{{- end }}
{{- end }}

{{/* Fails rendering when the sandbox service requires a bearer token that the agent runner is not given: the service's token set in its settings or env (not environments.tokenSecret, which both get), and none in the runner's env, settings or extraArgs (--environments-token). Every episode would fail at its lease (401). Call with the root context. */}}
{{- define "clawrl.checkRunnerToken" -}}
{{- $where := include "clawrl.environmentsOwnToken" . }}
{{- if $where }}
{{- $r := .Values.agentRunner }}
{{- $given := or (dig "environments_server" "token" "" ($r.settings | default dict)) (include "clawrl.envNames" (dict "env" $r.env "names" (list "CLAWRL_ENVIRONMENTS_SERVER__TOKEN"))) }}
{{- range ($r.extraArgs | default list) }}
{{- if or (eq . "--environments-token") (hasPrefix "--environments-token=" .) }}{{ $given = true }}{{ end }}
{{- end }}
{{- if not $given }}
{{- fail (printf "agentRunner: the sandbox service requires a bearer token (set in %s) that the agent runner is not given, so every lease would be refused (401): put the token in a Secret and name it in environments.tokenSecret (the service and the runner both get it) instead" $where) }}
{{- end }}
{{- end }}
{{- end }}
