// kestrel web UI: the one piece of script. It refreshes the live counts on the executions
// page every few seconds; every page works without it.
(function () {
  "use strict";
  var box = document.querySelector("[data-counts-url]");
  if (!box || !window.fetch) { return; }
  var url = box.getAttribute("data-counts-url");
  function refresh() {
    fetch(url, { credentials: "same-origin", headers: { "Accept": "application/json" } })
      .then(function (r) { return r.ok ? r.json() : null; })
      .then(function (data) {
        if (!data) { return; }
        box.querySelectorAll("[data-count]").forEach(function (el) {
          var path = el.getAttribute("data-count").split(".");
          var group = data[path[0]];
          if (group && typeof group[path[1]] === "number") {
            el.textContent = String(group[path[1]]);
          }
        });
      })
      .catch(function () { /* offline for a moment: keep the last counts */ });
  }
  setInterval(refresh, 5000);
}());
