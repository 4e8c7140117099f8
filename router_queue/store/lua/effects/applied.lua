-- effects/applied.lua: where a step's workspace effects go on one Redis
-- (store/effects.py, AppliedEffects, links it into the scripts that owe
-- them): any step may touch any key, so each is applied in the step that
-- makes its change, to the workspace's hash and ledger.

-- Set in `k`, the step's keys, where owe_ws (lib/ledger.lua) puts its
-- workspace's effects: ws_key and ledger_key, the workspace's hash and ledger
-- (k.ws, k.ledger), applied in the step.
local function ws_target(k, ws_key, ledger_key)
  k.ws, k.ledger = ws_key, ledger_key
  return k
end
