// pgdispatch console: small behaviours of our own (no build step; htmx is vendored apart).
// Times: the server renders every <time data-local> in UTC (pages work without JavaScript);
// here each is rewritten in the viewer's local time zone, with the UTC value in its tooltip.
// The form is the one of the charts, the reasons and the CLI, whatever the browser's locale:
// "2025-03-04 16:30:00 IST" (24-hour, ISO-like date, then the zone's short name).
(function () {
  "use strict";
  var fmt = new Intl.DateTimeFormat(undefined, {
    year: "numeric", month: "2-digit", day: "2-digit",
    hour: "2-digit", minute: "2-digit", second: "2-digit", hourCycle: "h23",
    timeZoneName: "short", numberingSystem: "latn"
  });
  function stamp(d) {
    var p = {};
    fmt.formatToParts(d).forEach(function (part) { p[part.type] = part.value; });
    return p.year + "-" + p.month + "-" + p.day + " " + p.hour + ":" + p.minute + ":" +
      p.second + (p.timeZoneName ? " " + p.timeZoneName : "");
  }
  function localize(root) {
    var nodes = (root || document).querySelectorAll("time[data-local]");
    for (var i = 0; i < nodes.length; i++) {
      var el = nodes[i];
      if (el.dataset.localized === el.getAttribute("datetime")) continue;
      var d = new Date(el.getAttribute("datetime"));
      if (isNaN(d.getTime())) continue;
      if (!el.dataset.utc) el.dataset.utc = el.textContent;
      el.textContent = stamp(d);
      el.title = el.dataset.utc;
      el.dataset.localized = el.getAttribute("datetime");
    }
  }
  document.addEventListener("DOMContentLoaded", function () { localize(document); });
  document.addEventListener("htmx:afterSettle", function (e) { localize(e.target); });

  // A session that ended while the page was open (webapp/auth.py): the server answers 401
  // with HX-Redirect, which htmx follows to the sign-in page. Should the header not arrive (a
  // proxy dropping it), never swap the answer into a fragment: show why, stop polling, and go
  // to the sign-in page the answer links to.
  var sessionEnded = false;
  document.addEventListener("htmx:beforeRequest", function (e) {
    if (sessionEnded) e.preventDefault();
  });
  document.addEventListener("htmx:beforeSwap", function (e) {
    var xhr = e.detail.xhr;
    if (!xhr || xhr.status !== 401) return;
    e.detail.shouldSwap = false;
    if (sessionEnded) return;
    sessionEnded = true;
    var answer = new DOMParser().parseFromString(xhr.responseText || "", "text/html");
    var banner = answer.getElementById("session-ended");
    var link = banner && banner.querySelector("a[href^='/']");
    var target = link ? link.getAttribute("href") : "/login?ended=1";
    var flash = document.getElementById("flash");
    if (flash && banner) {
      flash.replaceChildren(document.importNode(banner, true));
    }
    window.location.assign(target);
  });
})();
