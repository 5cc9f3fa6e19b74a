// kestrel web UI: the one piece of script; every page works without it. It refreshes the
// live counts on the executions page every few seconds, and reloads an execution's page
// when the execution's state changes (after an approval: it resumes, then completes).
(function () {
  "use strict";
  if (!window.fetch) { return; }
  function poll(url, every, use) {
    function tick() {
      fetch(url, { credentials: "same-origin", headers: { "Accept": "application/json" } })
        .then(function (r) { return r.ok ? r.json() : null; })
        .then(function (data) { if (data) { use(data); } })
        .catch(function () { /* offline for a moment: try again at the next tick */ });
    }
    return setInterval(tick, every);
  }

  var box = document.querySelector("[data-counts-url]");
  if (box) {
    poll(box.getAttribute("data-counts-url"), 5000, function (data) {
      box.querySelectorAll("[data-count]").forEach(function (el) {
        var path = el.getAttribute("data-count").split(".");
        var group = data[path[0]];
        if (group && typeof group[path[1]] === "number") {
          el.textContent = String(group[path[1]]);
        }
      });
    });
  }

  var state = document.querySelector("[data-state-url]");
  if (state) {
    var shown = state.getAttribute("data-state");
    var timer = poll(state.getAttribute("data-state-url"), 3000, function (data) {
      if (data.state === shown) { return; }
      // Not while someone types into a form: the next tick tries again.
      var active = document.activeElement;
      if (active && /^(INPUT|TEXTAREA|SELECT)$/.test(active.tagName)) { return; }
      clearInterval(timer);
      window.location.reload();
    });
  }
}());
