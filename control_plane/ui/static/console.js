// The console's own script: htmx sends the session's CSRF token on its requests (its live refreshes are
// GETs, which need none; this keeps any future hx-post covered).
document.addEventListener("htmx:configRequest", (event) => {
  const field = document.querySelector("input[name=csrf]");
  if (field) event.detail.headers["X-CSRF-Token"] = field.value;
});
