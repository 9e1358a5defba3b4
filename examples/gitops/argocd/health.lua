-- Argo CD health check for ProxyConfiguration (proxy.kpx.dev), in argocd-cm under
-- resource.customizations.health.proxy.kpx.dev_ProxyConfiguration (docs/gitops.md).
-- It reads the status as kstatus (sigs.k8s.io/cli-utils: Flux, kpt) does:
--   no status yet, or a status of an older generation  -> Progressing
--   Stalled=True (a person must change something)       -> Degraded
--   Reconciling=True (agents roll out, a switch runs)    -> Progressing
--   Ready=True                                           -> Healthy
--   otherwise (Ready=False: e.g. no node selected)       -> Progressing
local hs = { status = "Progressing", message = "waiting for the operator to write a status" }
if obj.status == nil or obj.status.conditions == nil then
  return hs
end
local generation = obj.metadata.generation
local observed = obj.status.observedGeneration
if generation ~= nil and (observed == nil or observed ~= generation) then
  hs.message = "waiting for the operator to act on generation " .. tostring(generation)
  return hs
end
local conditions = {}
for _, condition in ipairs(obj.status.conditions) do
  conditions[condition.type] = condition
end
local function said(condition)
  return condition.reason .. ": " .. (condition.message or "")
end
local stalled, reconciling, ready = conditions["Stalled"], conditions["Reconciling"], conditions["Ready"]
if stalled ~= nil and stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = said(stalled)
  return hs
end
if reconciling ~= nil and reconciling.status == "True" then
  hs.message = said(reconciling)
  return hs
end
if ready == nil then
  return hs
end
if ready.status == "True" then
  hs.status = "Healthy"
end
hs.message = said(ready)
return hs
