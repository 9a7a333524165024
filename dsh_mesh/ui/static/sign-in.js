// The sign-in page: a team's token (or the view's launch token) exchanged for the view's
// sign-in cookie, then back to the page that was asked for.
'use strict';

document.querySelector('#sign-in').addEventListener('submit', async (submit) => {
  submit.preventDefault();
  const message = document.querySelector('#message');
  message.textContent = '';
  const response = await fetch('/api/sign-in', {
    method: 'POST',
    headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({ token: document.querySelector('#token').value }),
  });
  if (response.ok) {
    // The page's key: sent with every request the page makes (the cookie alone reads nothing).
    localStorage.setItem('dsh-mesh-key', (await response.json()).csrf_token);
    const url = new URL(window.location);
    url.searchParams.delete('token');
    window.location.assign(`/${url.search}`);
    return;
  }
  const data = await response.json().catch(() => ({ error: response.status, detail: '' }));
  message.textContent = `${data.error}: ${data.detail}`;
  message.dataset.error = 'true';
});
